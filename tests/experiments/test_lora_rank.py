"""experiments/lora_rank.py in --smoke mode, so that it never rots: every rank and full
fine-tuning run, and the JSON holds the numbers the table promises."""

from __future__ import annotations

import pytest
from smoke_runs import smoke_run


@pytest.mark.slow
def test_smoke_run_writes_every_rank(tmp_path):
    results, _ = smoke_run("lora_rank", tmp_path)
    assert set(results) == {"frozen", "full", "continued", "lora_r1", "lora_r2",
                            "lora_r1_lr0.006", "lora_r1_lr0.02"}
    assert [results[f"lora_r1{lr}"]["learning_rate"] for lr in ("", "_lr0.006", "_lr0.02")] == [
        2e-3, 6e-3, 2e-2]
    # The control trained on the pretraining corpus only: measured, not fine-tuned, on xml/.
    assert results["continued"]["curve"] == [] and results["continued"]["trainable_params"] == 0
    assert results["continued"]["val_loss"] != results["frozen"]["val_loss"]
    for r in results.values():
        assert r["val_loss"] > 0
    # Two LoRA factors on q and v in every layer: r·(d_in + d_out) each.
    per_rank = results["lora_r1"]["trainable_params"]
    assert results["lora_r2"]["trainable_params"] == 2 * per_rank > 0
    assert results["full"]["trainable_fraction"] == pytest.approx(1.0)
