"""tfx.train.run.load_run: a trained run's model, tokenizer, experiment and step, and the
errors that say what to do."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from train_cases import tiny, write_corpus

import tfx
from tfx.train.checkpoint import CorruptCheckpointError
from tfx.train.config import run_identity
from tfx.train.loop import Trainer, train
from tfx.train.run import load_run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A 3-step char-GPT run with dropout (so eval mode matters), checkpoints at 2 and 3."""
    workdir = tmp_path_factory.mktemp("run")
    experiment = tiny("gpt_char", corpus, steps=3, checkpoint_every=2, eval_every=3)
    experiment = dataclasses.replace(experiment, model=experiment.model.replace(dropout=0.1))
    train(experiment, workdir, progress=False)
    return workdir, experiment


def _trainer_logits(workdir, experiment, ids):
    trainer = Trainer(experiment, workdir, sharded=False)
    try:
        trainer.restore(strict=True)
        return np.asarray(trainer.model()(ids))
    finally:
        trainer.close()


def test_the_loaded_model_is_the_trainers_in_eval_mode(trained):
    workdir, experiment = trained
    run = load_run(workdir)
    # The stored experiment: loop-only settings (log_every, ...) are not part of a run.
    assert run.step == 3 and run_identity(run.experiment) == run_identity(experiment)
    ids = run.tokenizer.encode("def f(x):")[None]
    logits = np.asarray(run.model(ids))
    # The trainer's own model at the same step, in eval mode: the same numbers.
    np.testing.assert_array_equal(logits, _trainer_logits(workdir, experiment, ids))
    np.testing.assert_array_equal(logits, np.asarray(run.model(ids)))  # no dropout


def test_a_loaded_run_generates_text(trained):
    run = load_run(trained[0])
    prompt = run.tokenizer.encode("def ")[None]
    out = tfx.generate(run.model, prompt, max_new_tokens=5, temperature=0.0)
    text = run.tokenizer.decode(np.asarray(out[0]))
    assert text.startswith("def ") and len(np.asarray(out[0])) == prompt.shape[1] + 5


def test_an_older_step_is_loaded_when_asked_for(trained):
    workdir, _ = trained
    older, newest = load_run(workdir, step=2), load_run(workdir)
    assert older.step == 2
    a = jax.tree.leaves(jax.tree.map(np.asarray, _params(older.model)))
    b = jax.tree.leaves(jax.tree.map(np.asarray, _params(newest.model)))
    assert any((x != y).any() for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError, match=r"step 5 is not in .*saved: \[2, 3\]"):
        load_run(workdir, step=5)


def _params(model):
    return nnx.state(model, nnx.Param)


def test_no_run_in_the_workdir_says_how_to_train_one(tmp_path):
    with pytest.raises(ValueError, match=r"no trained run in .*train one with `tfx train "
                                         r"--workdir"):
        load_run(tmp_path / "nothing")


def test_an_empty_workdir_path_is_refused():
    with pytest.raises(ValueError, match="workdir must not be an empty path"):
        load_run("")


def test_a_run_without_a_checkpoint_yet_is_named(tmp_path, trained):
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    for step in (2, 3):
        shutil.rmtree(workdir / "checkpoints" / str(step))
    with pytest.raises(ValueError, match=r"holds no checkpoint yet.* again to resume"):
        load_run(workdir)


def test_a_damaged_newest_checkpoint_is_refused_not_replaced(tmp_path, trained):
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    # Step 3's arrays no longer match their checksums, as after a bit flip on disk.
    record = workdir / "checkpoints" / "3" / "checksums" / "metadata"
    stored = json.loads(record.read_text())
    path = next(p for p in stored["leaves"] if p.startswith("params/"))
    stored["leaves"][path] = "0" * 16
    record.write_text(json.dumps(stored))
    with pytest.raises(CorruptCheckpointError, match=r"step 3 .* not falling back") as caught:
        load_run(workdir)
    assert "step=N) with N in [2]" in " ".join(caught.value.__notes__)
    assert load_run(workdir, step=2).step == 2  # asked for by name, the older step loads
