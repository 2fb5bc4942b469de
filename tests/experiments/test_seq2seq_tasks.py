"""experiments/seq2seq_tasks.py in --smoke mode, so that it never rots: the three runs train,
every checkpoint is measured, and the JSON holds the keys and numbers the table promises."""

from __future__ import annotations

import pytest
from smoke_runs import smoke_run

SMOKE_STEPS = 2  # the script's smoke runs, checkpointed at every step
PARTS = ("reverse", "addition", "addition_reversed")


def _rate(value) -> bool:
    return 0.0 <= value <= 1.0


@pytest.mark.slow
def test_smoke_run_measures_every_checkpoint(tmp_path):
    results, folder = smoke_run("seq2seq_tasks", tmp_path)
    assert set(results) == set(PARTS)
    steps = list(range(SMOKE_STEPS + 1))  # the initialisation, then every checkpoint

    for part in PARTS:
        r = results[part]
        assert r["task"]["name"] == part
        assert [p["step"] for p in r["checkpoints"]] == steps
        assert r["curve"] == [[p["step"], p["token_accuracy"]] for p in r["checkpoints"]]
        assert r["exact_match_curve"] == [[p["step"], p["exact_match"]]
                                          for p in r["checkpoints"]]
        final = r["checkpoints"][-1]
        for key in ("exact_match", "exact_match_unseen", "token_accuracy",
                    "teacher_forced_exact_match", "val_loss"):
            assert r[key] == final[key]
        for p in r["checkpoints"]:
            assert p["val_loss"] > 0
            for key in ("token_accuracy", "teacher_forced_exact_match", "exact_match"):
                assert _rate(p[key])
            assert p["exact_match_unseen"] is None or _rate(p["exact_match_unseen"])
        assert r["held_out_examples"] == 32
        assert _rate(r["held_out_seen_in_training"])
        # An untrained model cannot produce a whole answer and its EOS.
        assert r["checkpoints"][0]["exact_match"] == 0.0
    table = (folder / "seq2seq_tasks.md").read_text()
    assert all(f"| {part} (" in table for part in PARTS)
