"""experiments/lora_rank.py in --smoke mode, so that it never rots: every rank and full
fine-tuning run, and the JSON holds the numbers the table promises."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "experiments" / "lora_rank.py"


@pytest.mark.slow
def test_smoke_run_writes_every_rank(tmp_path):
    spec = importlib.util.spec_from_file_location("lora_rank", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "results.json"
    script.main(["--smoke", "--json", str(out), "--workdir", str(tmp_path / "runs"),
                 "--out", str(tmp_path / "results")])
    results = json.loads(out.read_text())
    assert set(results) == {"frozen", "full", "lora_r1", "lora_r2"}
    for r in results.values():
        assert r["val_loss"] > 0
    # Two LoRA factors on q and v in every layer: r·(d_in + d_out) each.
    per_rank = results["lora_r1"]["trainable_params"]
    assert results["lora_r2"]["trainable_params"] == 2 * per_rank > 0
    assert results["full"]["trainable_fraction"] == pytest.approx(1.0)
    for name in ("lora_rank.md", "lora_rank.png", "lora_rank.json"):
        assert (tmp_path / "results" / name).stat().st_size > 0
    published = json.loads((tmp_path / "results" / "lora_rank.json").read_text())
    assert published["command"].startswith("python experiments/lora_rank.py --smoke")
    assert published["results"] == results
