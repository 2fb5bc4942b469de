"""experiments/peft_compare.py in --smoke mode, so that it never rots: every method runs, and
the JSON holds the keys and numbers the table promises."""

from __future__ import annotations

import pytest
from smoke_runs import smoke_run

METHODS = {"full", "lora", "lora_seed_init", "prompt", "prefix", "adapter", "frozen"}


@pytest.mark.slow
def test_smoke_run_writes_every_method(tmp_path):
    results, _ = smoke_run("peft_compare", tmp_path)
    assert set(results) == METHODS
    for method, r in results.items():
        assert {"trainable_params", "trainable_fraction", "val_loss"} <= set(r)
        assert r["val_loss"] > 0
        assert (r["trainable_params"] == 0) == (method == "frozen")
    assert results["full"]["trainable_fraction"] == pytest.approx(1.0)
    for method in METHODS - {"full", "frozen"}:
        assert 0 < results[method]["trainable_fraction"] < 0.5
        assert results[method]["optimizer_bytes"] < results["full"]["optimizer_bytes"]
