"""experiments/posenc_extrapolation.py: its windows score the same tokens at every length, and
its --smoke run writes every encoding's losses at every context, null only where learned
positions run out."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
from smoke_runs import smoke_run

ENCODINGS = {"learned", "sinusoidal", "rope", "alibi", "t5", "xl", "none"}
CONTEXTS = ["128", "256", "512", "1024"]


@pytest.fixture(scope="module")
def script():
    return importlib.import_module("posenc_extrapolation")


@pytest.mark.parametrize("length", [128, 256, 512, 1024])
def test_windows_of_every_length_score_the_same_targets(script, length):
    spans = np.arange(3 * 1025, dtype=np.int32).reshape(3, 1025)
    cut = script.windows(spans, length)
    assert cut.shape == (3 * 1024 // length, length + 1)
    # Inputs and next-token targets are the spans' own, in order, each exactly once.
    np.testing.assert_array_equal(cut[:, :-1].reshape(3, 1024), spans[:, :-1])
    np.testing.assert_array_equal(cut[:, 1:].reshape(3, 1024), spans[:, 1:])


@pytest.mark.slow
def test_smoke_run_writes_every_encoding_and_context(tmp_path):
    results, folder = smoke_run("posenc_extrapolation", tmp_path)
    assert set(results) == ENCODINGS
    for encoding, losses in results.items():
        assert list(losses) == CONTEXTS
        for context, loss in losses.items():
            if encoding == "learned" and context != "128":
                assert loss is None  # beyond the table of 128 positions
            else:
                assert math.isfinite(loss) and 0 < loss < 2 * math.log(256)
    table = (folder / "posenc_extrapolation.md").read_text()
    assert table.count("beyond the learned table of 128 positions") == 3
