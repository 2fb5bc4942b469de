"""experiments/moe_vs_dense.py in --smoke mode, so that it never rots: the three models train,
and the JSON holds the keys the issue promises with numbers that obey their definitions."""

from __future__ import annotations

import math

import pytest
from smoke_runs import smoke_run

MODELS = ("dense", "moe_k1", "moe_k2")
FACTORS = ("1.0", "1.25", "2.0")


@pytest.mark.slow
def test_smoke_run_compares_dense_and_moe(tmp_path):
    results, _ = smoke_run("moe_vs_dense", tmp_path)

    assert set(results) == {*MODELS, "dropped_fraction"}
    for name in MODELS:
        r = results[name]
        assert math.isfinite(r["val_loss"]) and r["val_loss"] > 0
        assert r["tokens_per_s"] > 0
    # Equal active parameters: one expert of width d_ff, or two of d_ff / 2, plus the router.
    dense, k1, k2 = (results[name] for name in MODELS)
    assert k1["active_params"] == k2["active_params"]
    assert dense["active_params"] == dense["params"]
    # The smoke models: 1 layer of width 32, with an 8-expert router.
    assert k1["active_params"] - dense["active_params"] == 32 * 8
    assert k2["params"] < k1["params"]  # 8 experts of width d_ff / 2 against d_ff

    assert set(results["dropped_fraction"]) == set(FACTORS)
    for name in ("moe_k1", "moe_k2"):
        r = results[name]
        for shares in r["expert_load"]:
            assert len(shares) == 8 and sum(shares) == pytest.approx(1.0)
        drops = [results["dropped_fraction"][cf][name] for cf in FACTORS]
        assert all(0.0 <= d <= 1.0 for d in drops)
        assert drops == sorted(drops, reverse=True)  # more capacity, never more drops
        capacities = [r["capacity"][cf] for cf in FACTORS]
        assert capacities == sorted(capacities)
        for cf, dropped in zip(FACTORS, drops, strict=True):
            if dropped == 0.0:  # nothing dropped: the same computation as dropless
                assert r["val_loss_at_capacity"][cf] == pytest.approx(r["val_loss"], rel=1e-5)
