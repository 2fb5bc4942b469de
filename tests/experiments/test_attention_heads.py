"""experiments/attention_heads.py in --smoke mode, so that it never rots: every variant trains
and decodes, the JSON holds the keys the issue promises, and the KV-cache sizes are exactly
2 · layers · kv_heads · head_dim · 4 bytes per token."""

from __future__ import annotations

import importlib
import math
import statistics

import pytest
from smoke_runs import smoke_run

KEYS = {"kv_heads", "val_loss", "kv_bytes_per_token", "decode_tokens_per_s",
        "decode_tokens_per_s_rounds", "params", "train_tokens_per_s"}


@pytest.mark.slow
def test_smoke_run_measures_every_variant(tmp_path):
    results, _ = smoke_run("attention_heads", tmp_path)
    assert set(results) == {"mha", "gqa4", "gqa2", "mqa"}
    assert {name: r["kv_heads"] for name, r in results.items()} == {
        "mha": 8, "gqa4": 4, "gqa2": 2, "mqa": 1}
    script = importlib.import_module("attention_heads")
    model = script.variant_experiment(1, steps=3, smoke=True).model
    head_dim = model.d_model // model.num_heads
    for r in results.values():
        assert set(r) == KEYS
        assert math.isfinite(r["val_loss"]) and r["val_loss"] > 0
        assert r["kv_bytes_per_token"] == 2 * model.num_layers * r["kv_heads"] * head_dim * 4
        assert r["decode_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0
        assert r["decode_tokens_per_s"] == statistics.median(r["decode_tokens_per_s_rounds"])
    # Fewer key/value heads only shrink the key and value projections, d_model x head_dim each.
    for name in ("gqa4", "gqa2", "mqa"):
        removed = (results["mha"]["kv_heads"] - results[name]["kv_heads"]) * head_dim
        assert results["mha"]["params"] - results[name]["params"] == \
            2 * model.num_layers * model.d_model * removed
