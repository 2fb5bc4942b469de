"""How the `tfx` command line reads (tfx.cli.commands.parse), and its exit statuses for what
stops a command (tfx.cli.main), without training anything."""

from __future__ import annotations

import signal
import types
from pathlib import Path

import pytest

from tfx.cli import main, running
from tfx.cli.commands import Embed, Sample, Train, parse
from tfx.train.finetuning import LoraTuning, PromptTuning


def test_train_reads_the_experiment_its_overrides_and_the_shortcuts():
    command = parse(["train", "bert_mlm", "--workdir", "w", "--model.num_layers=2",
                     "--optim.learning_rate", "1e-3", "--model.norm.pre_norm", "True",
                     "--steps", "7", "--data", "corpus.txt", "--no_progress"])
    assert isinstance(command, Train) and command.no_progress
    experiment = command.configured()
    assert experiment.name == "bert_mlm" and experiment.model.num_layers == 2
    assert experiment.model.norm.pre_norm and experiment.optim.learning_rate == 1e-3
    assert experiment.train.steps == 7 and experiment.data.source == "corpus.txt"


def test_the_default_experiment_and_dashed_spellings():
    experiment = parse(["train", "--workdir", "w", "--model.num-layers=3",
                        "--checkpoint-every", "5"]).configured()
    assert experiment.name == "gpt_char" and experiment.model.num_layers == 3
    assert experiment.train.checkpoint_every == 5


def test_optional_sub_configs_switch_on_and_off():
    dense = parse(["train", "--workdir", "w", "--model.moe.num_experts=4"]).experiment
    assert dense.model.moe.num_experts == 4 and dense.model.moe.experts_per_token == 2
    assert parse(["train", "moe_gpt", "--workdir", "w", "--model.moe=None"]
                 ).experiment.model.moe is None


def test_the_grouped_spellings_of_the_short_options_are_read():
    experiment = parse(["train", "--workdir", "w", "--train.steps=9", "--train.log-every", "2",
                        "--train.checkpoint_every", "4", "--data.source", "d.txt"]).configured()
    assert experiment.train.steps == 9 and experiment.train.log_every == 2
    assert experiment.train.checkpoint_every == 4 and experiment.data.source == "d.txt"


@pytest.mark.parametrize("option", ["--init-from", "--train.init_from", "--train.init-from"])
def test_a_hugging_face_base_refuses_model_options_however_it_is_named(tmp_path, option):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    command = parse(["train", "--workdir", "w", option, str(tmp_path), "--model.num_layers=2"])
    with pytest.raises(ValueError, match=r"model\.num_layers cannot be set"):
        command.configured()


def test_an_experiments_name_is_its_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:  # not a name that no experiment has
        parse(["train", "--workdir", "w", "--name", "mine"])
    assert exit_.value.code == 2
    assert "--name" in capsys.readouterr().err


@pytest.mark.parametrize("args,expected", [
    (["--peft", "lora", "--peft.rank", "2", "--peft.targets", "query", "key"],
     LoraTuning(rank=2, targets=("query", "key"))),
    (["peft:prompt", "--peft.num_tokens", "3", "--peft.init", "random"],
     PromptTuning(num_tokens=3, init="random")),
    (["--peft=lora"], LoraTuning()),
])
def test_a_fine_tuning_method_is_a_subcommand_with_its_own_settings(args, expected):
    assert parse(["train", "--workdir", "w", *args]).experiment.peft == expected


def test_a_setting_of_another_method_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["train", "--workdir", "w", "--peft", "lora", "--peft.size", "4"])
    assert exit_.value.code == 2
    assert "--peft.size" in capsys.readouterr().err


def test_sample_and_embed():
    command = parse(["sample", "--workdir", "w", "--prompt", "def ", "--top_k", "5"])
    assert command == Sample(workdir="w", prompt="def ", top_k=5)
    assert parse(["embed", "a b", "c", "--output", "x.npy"]) == Embed(texts=("a b", "c"),
                                                                         output=Path("x.npy"))


@pytest.mark.parametrize("number,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_run_exits_128_plus_the_signal(monkeypatch, tmp_path, capsys, number,
                                                      status):
    import tfx.train.loop

    artifacts = {"checkpoints": tmp_path / "checkpoints", "loss_plot": tmp_path / "loss.png"}
    result = types.SimpleNamespace(step=3, signal=number, validation={}, artifacts=artifacts)
    monkeypatch.setattr(tfx.train.loop, "train", lambda *args, **kwargs: result)
    (tmp_path / "checkpoints").mkdir()
    assert main(["train", "--workdir", str(tmp_path)]) == status
    out, err = capsys.readouterr()
    assert f"artifacts: checkpoints: {tmp_path / 'checkpoints'}\n" in out  # loss.png: not yet
    assert f"interrupted at step 3 by {signal.Signals(number).name}" in err


def test_ctrl_c_outside_training_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(command):
        raise KeyboardInterrupt

    monkeypatch.setattr(running, "sample", interrupted)
    assert main(["sample", "--workdir", "w"]) == 130
    assert capsys.readouterr().err == "tfx sample: interrupted\n"
