"""experiments/bert_mlm.py in --smoke mode, so that it never rots: both runs train with BERT's
optimiser settings, every checkpoint is measured, and the JSON holds what the table shows."""

from __future__ import annotations

import importlib

import pytest
from smoke_runs import smoke_run

SMOKE_STEPS = 2  # the script's smoke runs, checkpointed at every step


@pytest.mark.slow
def test_smoke_run_measures_both_norm_placements(tmp_path):
    results, folder = smoke_run("bert_mlm", tmp_path)
    assert set(results) == {"post_norm", "pre_norm", "most_frequent_byte", "chance_accuracy"}
    # Byte-level text: the most frequent byte is one character, and holds more than a uniform
    # share of the 256 byte values.
    assert len(results["most_frequent_byte"]) == 1
    assert 1 / 256 < results["chance_accuracy"] < 1
    for name, pre_norm in (("post_norm", False), ("pre_norm", True)):
        r = results[name]
        assert r["pre_norm"] is pre_norm
        # harness.checkpointed caps the warmup at a fifth of the 2 smoke steps: none.
        assert (r["learning_rate"], r["warmup_steps"]) == (1e-4, 0)
        assert [step for step, _ in r["curve"]] == list(range(SMOKE_STEPS + 1))
        assert [step for step, _ in r["loss_curve"]] == list(range(SMOKE_STEPS + 1))
        assert all(0.0 <= accuracy <= 1.0 for _, accuracy in r["curve"])
        assert r["final_masked_accuracy"] == r["curve"][-1][1]
        assert 0 < r["val_loss"] == r["loss_curve"][-1][1]
    assert "left the plateau at step" in (folder / "bert_mlm.md").read_text()


def test_bert_recipe_keeps_bert_settings_and_scales_only_the_length():
    script = importlib.import_module("bert_mlm")
    experiment = script.bert_recipe(1000, pre_norm=False)
    optim = experiment.optim
    assert (optim.learning_rate, optim.b1, optim.b2, optim.weight_decay) == (1e-4, 0.9, 0.999,
                                                                               0.01)
    assert optim.warmup_steps == 10  # 1% of the steps, as BERT's 10,000 of 10^6
    assert experiment.model.norm.pre_norm is False
    assert script.bert_recipe(1000, pre_norm=True).model.norm.pre_norm is True


def test_left_plateau_is_the_first_step_above_chance_for_good():
    left = importlib.import_module("bert_mlm").left_plateau
    curve = [[0, 0.0], [50, 0.27], [100, 0.30], [150, 0.27], [200, 0.31], [250, 0.40]]
    assert left(curve, chance=0.265) == 200  # 150 is within 0.01 of chance: not left yet
    assert left(curve, chance=0.5) is None
    assert left([[0, 0.6]], chance=0.5) == 0
