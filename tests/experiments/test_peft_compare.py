"""experiments/peft_compare.py in --smoke mode, so that it never rots: every method runs, and
the JSON holds the keys and numbers the table promises."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "experiments" / "peft_compare.py"
METHODS = {"full", "lora", "lora_seed_init", "prompt", "prefix", "adapter", "frozen"}


@pytest.mark.slow
def test_smoke_run_writes_every_method(tmp_path):
    spec = importlib.util.spec_from_file_location("peft_compare", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "results.json"
    script.main(["--smoke", "--json", str(out), "--workdir", str(tmp_path / "runs"),
                 "--out", str(tmp_path / "results")])
    results = json.loads(out.read_text())
    assert set(results) == METHODS
    for method, r in results.items():
        assert {"trainable_params", "trainable_fraction", "val_loss"} <= set(r)
        assert r["val_loss"] > 0
        assert (r["trainable_params"] == 0) == (method == "frozen")
    assert results["full"]["trainable_fraction"] == pytest.approx(1.0)
    for method in METHODS - {"full", "frozen"}:
        assert 0 < results[method]["trainable_fraction"] < 0.5
        assert results[method]["optimizer_bytes"] < results["full"]["optimizer_bytes"]
    for name in ("peft_compare.md", "peft_compare.png"):
        assert (tmp_path / "results" / name).stat().st_size > 0
