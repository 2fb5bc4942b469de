"""`tfx train` itself on a mesh of 8 CPU devices (data x FSDP x tensor, expert-parallel
mixture of experts, context-parallel sequences) and as two processes joined by
jax.distributed: each ends where a one-device run of the same experiment ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from parallel._train_case import assert_same_training
from parallel.test_multiprocess import free_port
from test_cli import TINY
from train_cases import write_corpus

from tfx.train.config import experiment_from_dict
from tfx.train.loop import Trainer
from tfx.train.metrics import read_metrics

STEPS = 4


def _command(workdir, corpus, *extra, prefix=(), experiment="gpt_char"):
    return [sys.executable, "-m", "tfx", "train", experiment, *prefix, "--workdir", str(workdir),
            "--steps", str(STEPS), "--log-every", "1", "--checkpoint-every", str(STEPS),
            "--data", str(corpus), *TINY, *extra]


def _env(devices: int = 1) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           # the test session's flags (tests/conftest.py: cheaper compiles) stay
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} "
                        + os.environ.get("XLA_FLAGS", "")}
    for name in ("TFX_COORDINATOR_ADDRESS", "TFX_NUM_PROCESSES", "TFX_PROCESS_ID"):
        env.pop(name, None)
    return env


def _run_all(commands_and_envs):
    processes = [subprocess.Popen(c, env=e, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT) for c, e in commands_and_envs]
    try:
        logs = [p.communicate(timeout=600)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, log in zip(processes, logs, strict=True):
        assert p.returncode == 0, log[-4000:]


def _result(workdir):
    experiment = experiment_from_dict(json.loads(
        (workdir / "checkpoints" / "config.json").read_text()))
    trainer = Trainer(experiment, workdir)
    assert trainer.restore() == STEPS
    params = {"/".join(map(str, k)): np.asarray(v)
              for k, v in nnx.to_flat_state(trainer.state.params)}
    trainer.close()
    losses = [r["loss"] for r in read_metrics(workdir / "metrics.jsonl") if r["split"] == "train"]
    return losses, params, experiment.optim.learning_rate


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    corpus = write_corpus(folder)
    _run_all([(_command(folder / "run", corpus), _env())])
    return corpus, _result(folder / "run")


@pytest.mark.slow
def test_a_sharded_run_matches_one_device(tmp_path, single):
    corpus, (ref_losses, ref_params, lr) = single
    _run_all([(_command(tmp_path / "run", corpus, "--mesh.data=2", "--mesh.fsdp=2",
                        "--mesh.tensor=2"), _env(8))])
    losses, params, _ = _result(tmp_path / "run")
    assert_same_training(losses, params, ref_losses, ref_params, learning_rate=lr)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, single):
    corpus, (ref_losses, ref_params, lr) = single
    address = f"127.0.0.1:{free_port()}"
    _run_all([(_command(tmp_path / "run", corpus, prefix=(
        "--coordinator-address", address, "--num-processes", "2", "--process-id", str(i))),
        _env()) for i in range(2)])
    losses, params, _ = _result(tmp_path / "run")
    assert_same_training(losses, params, ref_losses, ref_params, learning_rate=lr)


@pytest.mark.slow
def test_an_expert_parallel_run_matches_one_device(tmp_path):
    # Each device routes its own tokens, so the load-balancing loss is a mean over groups
    # there: weight 0, so that both runs compute the same loss.
    corpus = write_corpus(tmp_path)
    moe = ("--model.moe.num_experts=4", "--model.moe.d_ff=32", "--train.load_balancing_weight=0.0",
           "--train.batch_size=8")
    _run_all([(_command(tmp_path / "one", corpus, *moe, experiment="moe_gpt"), _env()),
              (_command(tmp_path / "eight", corpus, *moe, "--mesh.data=2", "--mesh.expert=4",
                        experiment="moe_gpt"), _env(8))])
    ref_losses, ref_params, lr = _result(tmp_path / "one")
    losses, params, _ = _result(tmp_path / "eight")
    assert_same_training(losses, params, ref_losses, ref_params, learning_rate=lr)


@pytest.mark.slow
def test_a_context_parallel_run_matches_one_device(tmp_path, single):
    # mesh.sequence=4: every sequence split over 4 devices (ring attention), rows over 2.
    corpus, (ref_losses, ref_params, lr) = single
    _run_all([(_command(tmp_path / "run", corpus, "--mesh.data=2", "--mesh.sequence=4"),
               _env(8))])
    losses, params, _ = _result(tmp_path / "run")
    assert_same_training(losses, params, ref_losses, ref_params, learning_rate=lr)


@pytest.mark.slow
def test_lora_sft_of_a_hugging_face_folder_on_a_mesh_matches_one_device(tmp_path):
    # Start from a transformers folder, LoRA, packed examples and remat, on data x FSDP x
    # tensor: the fine-tuning path meets the mesh as training from scratch does.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hf_folders import chat_model_folder

    folder = chat_model_folder(torch, transformers, tmp_path / "llama")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": f"{i} plus {i}?", "completion": f"{2 * i}."})
                             + "\n" for i in range(40)))

    def command(workdir, *mesh):  # the folder gives the model: no TINY model options
        return [sys.executable, "-m", "tfx", "train", "sft", "--workdir", str(workdir),
                "--init-from", str(folder), "--data", str(chats), "--steps", str(STEPS),
                "--log-every", "1", "--checkpoint-every", str(STEPS), "--no-progress",
                "--train.batch-size=4", "--train.seq-len=32", "--train.eval-batches=1",
                "--data.packing=True", "--model.compute.remat=True", *mesh, "--peft", "lora",
                "--peft.targets", "query", "value", "down"]

    _run_all([(command(tmp_path / "one"), _env()),
              (command(tmp_path / "eight", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2"),
               _env(8))])
    ref_losses, ref_params, lr = _result(tmp_path / "one")
    losses, params, _ = _result(tmp_path / "eight")
    assert_same_training(losses, params, ref_losses, ref_params, learning_rate=lr)


@pytest.mark.slow
def test_two_processes_reading_their_own_rows_of_token_shards_match_one(tmp_path):
    # Each process reads only the windows of its own rows (TextFeed.reads_rows); the run equals
    # a one-process run on the same shards.
    text = write_corpus(tmp_path).read_text()
    corpus = tmp_path / "documents"
    corpus.mkdir()
    for i in range(4):  # documents, for the train / val split of the shards
        (corpus / f"{i}.txt").write_text(text[i * len(text) // 4:(i + 1) * len(text) // 4])
    shards = tmp_path / "shards"
    _run_all([([sys.executable, "-m", "tfx", "tokenize", str(corpus), "--out", str(shards),
                "--no-progress"], _env())])
    address = f"127.0.0.1:{free_port()}"
    _run_all([(_command(tmp_path / "one", shards), _env()),  # the reference, alongside
              *((_command(tmp_path / "two", shards, prefix=(
                  "--coordinator-address", address, "--num-processes", "2",
                  "--process-id", str(i))), _env()) for i in range(2))])
    ref_losses, ref_params, lr = _result(tmp_path / "one")
    losses, params, _ = _result(tmp_path / "two")
    assert_same_training(losses, params, ref_losses, ref_params, learning_rate=lr)
