"""Fine-tuning runs: `train.init_from` + `peft.method` train only the PEFT parameters, keep the
base weights bit-for-bit, checkpoint only what they train, and resume."""

from __future__ import annotations

import dataclasses
import json

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from train_cases import tiny, write_corpus

from tfx.cli import main
from tfx.peft import PeftParam
from tfx.train.config import TrainConfig, experiment_from_dict, run_identity
from tfx.train.finetuning import peft_config
from tfx.train.loop import Trainer, train
from tfx.train.pretrained import pretrained_params


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("peft")
    corpus = write_corpus(folder)
    experiment = tiny("gpt_char", corpus, steps=4)
    train(experiment, folder / "base", progress=False)
    return folder, experiment


def _finetune(base, method, **settings):
    folder, experiment = base
    return dataclasses.replace(
        experiment, peft=peft_config(method, **settings),
        train=dataclasses.replace(experiment.train, init_from=str(folder / "base")))


SMALL = {"lora": {"rank": 2}, "adapter": {"size": 4}, "prefix": {"num_tokens": 3},
         "prompt": {"num_tokens": 3}}


@pytest.mark.parametrize("method", list(SMALL))
def test_finetuning_trains_only_the_method_parameters(base, method):
    folder, experiment = base
    base_params = jax.tree.map(np.asarray, pretrained_params(folder / "base", experiment.model))
    finetune = _finetune(base, method, **SMALL[method])
    trainer = Trainer(finetune, folder / method)
    initial = jax.tree.map(np.asarray, trainer.state.params)
    assert all(isinstance(v, PeftParam) for _, v in nnx.to_flat_state(trainer.state.params))
    train(finetune, folder / method, progress=False)
    after = Trainer(finetune, folder / method)
    assert after.restore() == finetune.train.steps
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, after.state.frozen), base_params)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), initial,
                           jax.tree.map(np.asarray, after.state.params))
    assert any(jax.tree.leaves(changed))
    # the optimiser holds state for the PEFT parameters only (AdamW's mu and nu)
    trainable = sum(x.size for x in jax.tree.leaves(after.state.params))
    assert sum(x.size for x in jax.tree.leaves(after.state.opt_state)) < 2 * trainable + 8
    assert after.evaluate()["loss"] > 0


def test_checkpoints_hold_only_the_trained_parameters(base):
    folder, _ = base
    finetune = _finetune(base, "lora", rank=2)
    train(finetune, folder / "lora_ckpt", progress=False)
    steps = sorted(p for p in (folder / "lora_ckpt" / "checkpoints").iterdir() if p.is_dir())
    tree = (steps[-1] / "default" / "_METADATA").read_text()  # orbax's tree of stored arrays
    assert "lora_a" in tree and "lora_b" in tree
    assert "kernel" not in tree and "frozen" not in tree


def test_cli_fine_tunes_with_space_separated_settings(base, capsys):
    folder, _ = base
    args = ["train", "--workdir", str(folder / "cli"), "--init-from", str(folder / "base"),
            "--peft", "lora", "--peft.rank", "2", "--peft.targets", "query", "key",
            "--steps", "2", "--data", str(folder / "corpus.txt"), "--no-progress",
            "--model.num_layers=1", "--model.d_model=32", "--model.num_heads=2",
            "--model.attention.num_kv_heads", "None", "--model.d_ff=64", "--train.seq_len=32",
            "--train.batch_size=4", "--train.eval_batches=1"]
    assert main(args) == 0
    experiment = experiment_from_dict(json.loads(
        (folder / "cli" / "checkpoints" / "config.json").read_text()))
    assert experiment.peft.method == "lora" and experiment.peft.rank == 2
    assert experiment.peft.targets == ("query", "key")
    capsys.readouterr()
    assert main(["sample", "--workdir", str(folder / "cli"), "--prompt", "def ",
                 "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["eval", "--workdir", str(folder / "cli")]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2


def test_bad_init_from_is_refused(base, tmp_path):
    folder, experiment = base
    with pytest.raises(ValueError, match=r"init_from: .* holds no trained run"):
        pretrained_params(tmp_path, experiment.model)
    with pytest.raises(ValueError, match=r"trained another model; .*d_model"):
        pretrained_params(folder / "base", experiment.model.replace(d_model=64))
    peft_run = _finetune(base, "lora", rank=2)
    peft_run = dataclasses.replace(peft_run, train=dataclasses.replace(peft_run.train, steps=1))
    train(peft_run, folder / "peft_base", progress=False)
    with pytest.raises(ValueError, match="trained only lora parameters"):
        pretrained_params(folder / "peft_base", experiment.model)
    with pytest.raises(ValueError, match=r"peft\.method must be one of"):
        peft_config("ia3")
    assert isinstance(TrainConfig(init_from="x").init_from, str)


def test_runs_without_fine_tuning_keep_the_identity_older_runs_stored(base):
    identity = run_identity(base[1])
    assert "peft" not in identity and "init_from" not in identity["train"]
    assert "peft" in run_identity(_finetune(base, "lora"))
