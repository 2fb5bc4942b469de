"""`tfx --help` and `tfx train --help` print without importing jax (so they print at once), and
the help says what each field is and what it may be."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Runs the command line as `python -m tfx` does, then lists the jax and flax modules it loaded.
_WRAPPER = """
import runpy, sys
sys.argv = ["tfx", *sys.argv[1:]]
try:
    runpy.run_module("tfx", run_name="__main__")
except SystemExit as exit_:
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax"))
    print("LOADED:", loaded, "STATUS:", exit_.code)
"""


def _help(*args: str) -> str:
    done = subprocess.run([sys.executable, "-c", _WRAPPER, *args], capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout


@pytest.mark.parametrize("args", [("--help",), ("train", "--help"), ("train", "bert_mlm", "-h")])
def test_help_imports_no_jax(args):
    out = _help(*args)
    assert out.rstrip().endswith("LOADED: [] STATUS: 0"), out[-500:]


def test_train_help_describes_fields_and_shows_choices():
    out = _help("train", "--help")
    assert "--model.position {learned,sinusoidal,rope,alibi,t5,xl,none}" in out
    assert "--model.mlp.activation {gelu,gelu_tanh,relu,silu}" in out
    assert "How the model knows where tokens are" in out  # TransformerConfig.position's docstring
    assert "Total optimiser steps." in out  # TrainConfig.steps's
    assert "gpt_char" in out and "bert_mlm" in out  # the experiments, as subcommands


def test_the_top_level_help_lists_the_commands():
    out = _help("--help")
    for command in ("train", "sample", "eval", "embed", "experiments"):
        assert command in out
