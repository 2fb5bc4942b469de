"""`tfx --help` and `tfx train --help` print without importing jax (so they print at once);
`tfx train --help` shows the options most runs set and where the rest is, `tfx train EXPERIMENT
--help` every option once, saying what each field is and what it may be."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tfx.cli.commands import parse

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


def _help_of(capsys, monkeypatch, *args: str) -> str:
    """What `tfx ARGS` prints (help: it exits 0), in this process, 80 columns wide."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_:
        parse(list(args))
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _options(help_text: str) -> list[str]:
    """The options that a help lists, in order: tyro starts each entry on a line of its own, in
    a box or (printing to a file) indented by two spaces."""
    return re.findall(r"^(?:│ |  )(?:-h, )?(--[a-z][\w.:-]*)", help_text, re.M)


def test_an_experiments_help_describes_its_fields_and_shows_choices(capsys, monkeypatch):
    out = _help_of(capsys, monkeypatch, "train", "gpt_char", "--help")
    assert "--model.position {learned,sinusoidal,rope,alibi,t5,xl,none}" in out
    assert "--model.mlp.activation {gelu,gelu_tanh,relu,silu}" in out
    assert "How the model knows where tokens are" in out  # TransformerConfig.position's docstring
    assert "Total optimiser steps. (default: 300)" in out  # TrainConfig.steps's, gpt_char's value
    assert "peft:lora" in out  # the fine-tuning methods, as subcommands


def test_train_help_shows_the_common_options_and_where_the_rest_is(capsys, monkeypatch):
    out = _help_of(capsys, monkeypatch, "train", "--help")
    assert _options(out) == ["--help", "--workdir", "--data", "--steps", "--init_from",
                             "--train.batch_size", "--train.seq_len", "--optim.learning_rate",
                             "--model.num_layers", "--model.d_model", "--model.num_heads"]
    assert "gpt_char" in out and "bert_mlm" in out  # the experiments, as subcommands
    assert "`tfx train EXPERIMENT --help` lists every option" in out
    assert "Fine-tuning: `tfx train sft --init-from HF_FOLDER" in out
    assert "--peft {full,lora,prompt,prefix,adapter}" in out
    full = _help_of(capsys, monkeypatch, "train", "gpt_char", "--help")
    assert len(out.splitlines()) < 100 < 300 < len(full.splitlines())  # was 392 lines (full)


@pytest.mark.parametrize("experiment", ["gpt_char", "bert_mlm", "seq2seq_reverse", "dpo"])
def test_no_option_is_listed_twice(capsys, monkeypatch, experiment):
    options = _options(_help_of(capsys, monkeypatch, "train", experiment, "--help"))
    assert len(options) == len(set(options)) > 100
    assert "--steps" in options and "--data" in options and "--init_from" in options
    # The grouped spellings of the short options are read (test_cli_parse), never listed; an
    # experiment's name is its subcommand's.
    assert not {"--train.steps", "--data.source", "--train.init_from", "--name"} & set(options)


def test_the_optional_parts_an_experiment_leaves_out_are_listed(capsys, monkeypatch):
    dense = _help_of(capsys, monkeypatch, "train", "gpt_char", "--help")
    assert "--model.moe.num_experts INT" in dense and "--model.moe.policy" in dense
    assert "Off in gpt_char: naming any of these options switches it on" in dense
    assert "Off in" not in _help_of(capsys, monkeypatch, "train", "moe_gpt", "--help")


def test_the_top_level_help_lists_the_commands():
    out = _help("--help")
    for command in ("train", "sample", "eval", "embed", "experiments"):
        assert command in out
