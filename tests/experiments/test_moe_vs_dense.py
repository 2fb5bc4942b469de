"""experiments/moe_vs_dense.py in --smoke mode, so that it never rots: the four models train,
and the JSON holds the keys the issue promises with numbers that obey their definitions."""

from __future__ import annotations

import math

import pytest
from smoke_runs import smoke_run

MODELS = ("dense", "dense_wide", "moe_k1", "moe_k2")
FACTORS = ("1.0", "1.25", "2.0")
SMOKE_TOKENS = 3 * 4 * 32  # steps x batch x sequence of harness.smoke_train


@pytest.mark.slow
def test_smoke_run_compares_dense_and_moe(tmp_path):
    results, _ = smoke_run("moe_vs_dense", tmp_path)

    assert set(results) == {*MODELS, "dropped_fraction"}
    for name in MODELS:
        r = results[name]
        assert math.isfinite(r["val_loss"]) and r["val_loss"] > 0
        assert r["tokens_per_s"] > 0
    dense, wide, k1, k2 = (results[name] for name in MODELS)
    # The smoke models: 1 layer of width 32; the active MLP is 64 wide: one SwiGLU expert of
    # width 64 (4 experts) or two of width 32 (8 experts), plus the router.
    assert dense["active_params"] == dense["params"]
    assert k1["active_params"] - dense["active_params"] == 32 * 4
    assert k2["active_params"] - dense["active_params"] == 32 * 8
    # Equal totals: 4 x 64 = 8 x 32 = 256 wide, each a SwiGLU of 3 matrices d_model x width.
    assert k1["params"] - wide["params"] == 32 * 4
    assert k2["params"] - wide["params"] == 32 * 8
    assert wide["params"] - dense["params"] == 3 * 32 * (256 - 64)
    # Each expert gets k / E = 1/4 of the tokens; a dense MLP all of them.
    assert dense["tokens_per_expert"] == wide["tokens_per_expert"] == SMOKE_TOKENS
    assert k1["tokens_per_expert"] == k2["tokens_per_expert"] == SMOKE_TOKENS // 4

    assert set(results["dropped_fraction"]) == set(FACTORS)
    for name in ("moe_k1", "moe_k2"):
        r = results[name]
        for shares in r["expert_load"]:
            assert len(shares) == {"moe_k1": 4, "moe_k2": 8}[name]
            assert sum(shares) == pytest.approx(1.0)
        drops = [results["dropped_fraction"][cf][name] for cf in FACTORS]
        assert all(0.0 <= d <= 1.0 for d in drops)
        assert drops == sorted(drops, reverse=True)  # more capacity, never more drops
        capacities = [r["capacity"][cf] for cf in FACTORS]
        assert capacities == sorted(capacities)
        for cf, dropped in zip(FACTORS, drops, strict=True):
            if dropped == 0.0:  # nothing dropped: the same computation as dropless
                assert r["val_loss_at_capacity"][cf] == pytest.approx(r["val_loss"], rel=1e-5)
