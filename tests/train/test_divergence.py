"""Non-finite steps: the train step leaves the state as it was and counts them; the loop stops
before saving such a state (train.nonfinite="stop") or skips them up to a limit ("skip"), and
keep-K only ever counts good checkpoints."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_cases import tiny, write_corpus

from tfx.models import create
from tfx.train.config import OptimConfig, TrainConfig, run_identity
from tfx.train.loop import DivergenceError, Trainer, train
from tfx.train.losses import causal_lm
from tfx.train.metrics import read_metrics
from tfx.train.objectives import CausalLM, get_objective
from tfx.train.optim import make_optimizer
from tfx.train.step import init_train_state, make_train_step

POISON = 255  # a batch whose first token is this one gets a non-finite loss or gradient


def _poisoned(kind: str):
    """causal_lm whose loss (kind "loss": NaN) or gradient norm (kind "grad_norm": the
    gradient overflows, the loss stays finite) is non-finite on batches starting with POISON."""
    def objective(model, batch, rng):
        total, count, sums = causal_lm(model, batch, rng)
        poisoned = batch["tokens"][0, 0] == POISON
        if kind == "loss":
            return total * jnp.where(poisoned, jnp.nan, 1.0), count, sums
        weights = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
        huge = 1e30 * jnp.sum(jnp.square(weights))  # cancels below; its gradient's norm is inf
        return total + jnp.where(poisoned, huge - jax.lax.stop_gradient(huge), 0.0), count, sums
    return objective


def _batches():
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (2, 4, 17), 0, POISON))
    bad = tokens[1].copy()
    bad[0, 0] = POISON
    return {"tokens": tokens[0]}, {"tokens": bad}


def _one_update(optimizer, graphdef, rest, state, batch):
    """The reference: one AdamW update of the mean next-token loss, written out with optax."""
    def mean_loss(params):
        logits = nnx.merge(graphdef, params, rest)(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    grads = jax.grad(mean_loss)(state.params)
    updates, _ = optimizer.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates)


@pytest.mark.parametrize("kind", ["loss", "grad_norm"])
def test_a_non_finite_step_changes_nothing_but_the_step_and_its_counters(kind):
    e = tiny("gpt_char")
    model = create(e.model, rngs=nnx.Rngs(0))
    optimizer = make_optimizer(OptimConfig(warmup_steps=0), 10)
    graphdef, rest, state = init_train_state(model, optimizer, seed=0)
    step = make_train_step(graphdef, rest, optimizer, _poisoned(kind))
    good, bad = _batches()
    state, _ = step(state, good)
    before = jax.tree.map(np.asarray, state)
    state, metrics = step(state, bad)
    assert not np.isfinite(float(metrics[kind]))
    chex.assert_trees_all_equal(state.params, before.params)
    chex.assert_trees_all_equal(state.opt_state, before.opt_state)
    assert int(state.step) == 2
    counts = jax.device_get(state.nonfinite)
    assert (counts.skipped, counts.streak, counts.longest, counts.first) == (1, 1, 1, 2)
    expected = _one_update(optimizer, graphdef, rest, state, good)  # from the step-1 state
    state, metrics = step(state, good)
    assert np.isfinite(float(metrics["loss"]))
    chex.assert_trees_all_close(state.params, expected, atol=1e-6)
    counts = jax.device_get(state.nonfinite)
    assert (counts.skipped, counts.streak, counts.longest, counts.first) == (1, 0, 1, 2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _poison_steps(monkeypatch, experiment, steps):
    """Make the loop's causal LM objective NaN on the batches of these (1-based) steps."""
    feed = get_objective(experiment.objective).batches(experiment)
    bad = jnp.asarray(np.stack([feed.train(s - 1)["tokens"] for s in steps]))

    def objective(model, batch, rng):
        total, count, sums = causal_lm(model, batch, rng)
        poisoned = jnp.any(jnp.all(batch["tokens"][None] == bad, axis=(1, 2)))
        return total * jnp.where(poisoned, jnp.nan, 1.0), count, sums

    monkeypatch.setattr(CausalLM, "loss", lambda self, experiment: objective)


def _saved_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _saved_params(workdir, experiment, step):
    trainer = Trainer(experiment, workdir)
    template = trainer.state.to_dict()
    _, values = trainer.checkpoints.restore(template, step=step)
    trainer.close()
    return values["params"]


def test_stop_raises_before_saving_and_keeps_the_last_good_checkpoint(tmp_path, corpus,
                                                                       monkeypatch):
    # Checkpoints every 2 steps, only the newest kept: before the fix step 6 (NaN-trained)
    # was saved and the good step 4 rotated out.
    experiment = tiny("gpt_char", corpus, checkpoint_every=2, keep_checkpoints=1)
    _poison_steps(monkeypatch, experiment, [5])
    with pytest.raises(DivergenceError, match=r"step 5 had a non-finite loss.*stopped at "
                                              r"step 6 without saving.*checkpoint: step 4"):
        train(experiment, tmp_path, progress=False)
    assert _saved_steps(tmp_path) == [4]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert max(r["step"] for r in records) == 4
    assert all(np.isfinite(r["loss"]) for r in records)


def test_skip_goes_on_and_counts_the_skipped_steps(tmp_path, corpus, monkeypatch, capsys):
    experiment = tiny("gpt_char", corpus, nonfinite="skip")
    _poison_steps(monkeypatch, experiment, [2, 5])
    result = train(experiment, tmp_path, progress=False)
    assert result.step == 6 and np.isfinite(result.validation["loss"])
    train_records = [r for r in read_metrics(tmp_path / "metrics.jsonl")
                     if r["split"] == "train"]
    assert [r["skipped_steps"] for r in train_records] == [1, 1, 2]
    assert "skipped 2 step(s) with a non-finite loss" in capsys.readouterr().out
    for step in _saved_steps(tmp_path):
        params = _saved_params(tmp_path, experiment, step)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_skip_stops_after_too_many_skipped_steps_in_a_row(tmp_path, corpus, monkeypatch):
    experiment = tiny("gpt_char", corpus, nonfinite="skip", max_consecutive_skips=2,
                      checkpoint_every=2)
    _poison_steps(monkeypatch, experiment, [3, 4, 5])
    with pytest.raises(DivergenceError, match="3 steps in a row"):
        train(experiment, tmp_path, progress=False)
    assert _saved_steps(tmp_path) == [2, 4]  # step 4: 2 in a row, within the limit


def test_the_nonfinite_settings_are_not_part_of_a_runs_identity():
    # A run stored before these settings existed, or stopped with "stop", resumes with "skip".
    experiment = tiny("gpt_char")
    skipping = dataclasses.replace(experiment, train=dataclasses.replace(
        experiment.train, nonfinite="skip", max_consecutive_skips=3))
    identity = run_identity(experiment)
    assert run_identity(skipping) == identity
    assert not {"nonfinite", "max_consecutive_skips"} & identity["train"].keys()


@pytest.mark.parametrize("field,value,message", [
    ("nonfinite", "ignore", r"nonfinite must be one of \('stop', 'skip'\), got 'ignore'"),
    ("max_consecutive_skips", 0, "max_consecutive_skips must be >= 1"),
])
def test_bad_nonfinite_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})
