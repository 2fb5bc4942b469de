"""Train steps against a hand-written optax update, and gradient accumulation against one big
batch."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_cases import tiny

from tfx.models import create, moe_losses
from tfx.train.experts import expert_loads
from tfx.train.losses import causal_lm, sequence_to_sequence
from tfx.train.objectives import get_objective
from tfx.train.optim import make_optimizer
from tfx.train.step import (
    finish_eval,
    init_train_state,
    initial_state,
    make_eval_step,
    make_train_step,
    restore_template,
)


def _setup(name, **model_changes):
    e = tiny(name)
    model = create(e.model.replace(**model_changes), rngs=nnx.Rngs(0))
    optimizer = make_optimizer(e.optim, 10)
    return e, model, optimizer


def _tokens(seed=0, batch=4, length=17):
    return {"tokens": jax.random.randint(jax.random.key(seed), (batch, length), 0, 256)}


def test_train_step_is_one_adamw_update_of_the_mean_loss():
    _, model, optimizer = _setup("gpt_char")
    graphdef, rest, state = init_train_state(model, optimizer, seed=0)
    params0 = state.params
    step = make_train_step(graphdef, rest, optimizer, causal_lm)
    batch = _tokens()

    def mean_loss(params):
        logits = nnx.merge(graphdef, params, rest)(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    loss, grads = jax.value_and_grad(mean_loss)(params0)
    updates, _ = optimizer.update(grads, optimizer.init(params0), params0)
    expected = optax.apply_updates(params0, updates)
    new_state, metrics = step(jax.tree.map(jnp.copy, state), batch)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-4)
    chex.assert_trees_all_close(new_state.params, expected, atol=1e-6)
    assert int(new_state.step) == 1


@pytest.mark.parametrize("name", ["gpt_char", "seq2seq_reverse"])
def test_gradient_accumulation_equals_the_full_batch(name):
    e, model, optimizer = _setup(name)
    objective = causal_lm if name == "gpt_char" else sequence_to_sequence
    if name == "gpt_char":
        batch = _tokens(batch=8)
    else:
        batch = jax.tree.map(jnp.asarray, get_objective(e.objective).batches(e).train(0))
        batch = jax.tree.map(lambda x: x[:8], batch)
    results = []
    for accum in (1, 4):
        graphdef, rest, state = init_train_state(model, optimizer, seed=0)
        step = make_train_step(graphdef, rest, optimizer, objective, grad_accum=accum)
        results.append(step(state, batch))
    (s1, m1), (s4, m4) = results
    chex.assert_trees_all_close(m1, m4, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(s1.params, s4.params, rtol=1e-5, atol=1e-6)


def test_dropout_draws_from_the_step_key():
    _, model, optimizer = _setup("gpt_char", dropout=0.3)
    graphdef, rest, state = init_train_state(model, optimizer, seed=0)
    step = make_train_step(graphdef, rest, optimizer, causal_lm)
    batch = _tokens()
    _, a = step(jax.tree.map(jnp.copy, state), batch)
    _, b = step(jax.tree.map(jnp.copy, state), batch)
    np.testing.assert_array_equal(a["loss"], b["loss"])  # same step, same key, same masks
    _, c = step(dataclasses.replace(jax.tree.map(jnp.copy, state), step=state.step + 1), batch)
    assert a["loss"] != c["loss"]  # another step, another dropout draw
    eval_step = make_eval_step(graphdef, rest, causal_lm)
    plain = eval_step(state, batch, jax.random.key(0))
    other = eval_step(state, batch, jax.random.key(1))
    chex.assert_trees_all_close(plain, other)  # eval: no dropout


def test_finish_eval_weights_batches_by_their_targets():
    results = [(jnp.float32(6.0), jnp.float32(3.0), {"correct": jnp.float32(1.0),
                                                     "targets": jnp.float32(3.0)}),
               (jnp.float32(1.0), jnp.float32(1.0), {"correct": jnp.float32(1.0),
                                                     "targets": jnp.float32(1.0)})]
    out = finish_eval(results)
    assert out == pytest.approx({"loss": 7.0 / 4.0, "accuracy": 0.5})


@pytest.mark.parametrize("changes", [dict(compute={"dtype": "bfloat16"}),
                                     dict(compute={"remat": True})])
def test_mixed_precision_and_remat_train_float32_weights(changes):
    _, reference, optimizer = _setup("gpt_char")
    _, model, _ = _setup("gpt_char", **changes)
    batch = _tokens()
    outcomes = []
    for m in (reference, model):
        graphdef, rest, state = init_train_state(m, optimizer, seed=0)
        outcomes.append(make_train_step(graphdef, rest, optimizer, causal_lm)(state, batch))
    (ref_state, ref_metrics), (state, metrics) = outcomes
    leaves = jax.tree.leaves((state.params, state.opt_state))
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in leaves)  # master weights, moments
    if changes["compute"].get("remat"):  # the same computation, recomputed in the backward pass
        chex.assert_trees_all_close(state.params, ref_state.params, atol=1e-6)
    else:  # bfloat16 matmuls: the loss within bfloat16 rounding of float32's
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=2e-2)


def test_moe_losses_join_the_training_loss():
    _, model, optimizer = _setup("moe_gpt")
    graphdef, rest, state = init_train_state(model, optimizer, seed=0)
    batch = _tokens()
    reference = nnx.merge(graphdef, state.params, rest)
    reference.train()
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(
        reference(batch["tokens"][:, :-1]), batch["tokens"][:, 1:]).mean()
    losses = moe_losses(reference)
    step = make_train_step(graphdef, rest, optimizer, causal_lm, load_balancing_weight=0.5,
                           router_z_weight=0.1)
    _, metrics = step(jax.tree.map(jnp.copy, state), batch)
    for name, value in losses.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], cross_entropy + 0.5 * losses["load_balancing_loss"]
                               + 0.1 * losses["router_z_loss"], rtol=1e-5)


def test_deepseek_selection_bias_moves_by_the_rate_not_by_the_optimiser():
    _, model, optimizer = _setup("moe_gpt", moe={"policy": "deepseek", "shared_experts": 1})
    graphdef, rest, state = init_train_state(model, optimizer, seed=0)
    step = make_train_step(graphdef, rest, optimizer, causal_lm, grad_accum=2,
                           router_bias_rate=0.01)
    batch = _tokens(batch=8)
    loads = expert_loads(nnx.merge(graphdef, state.params, rest))
    assert list(loads) == ["stack/layers/0/mlp/selection_bias"]
    for _ in range(3):
        state, metrics = step(state, batch)
    bias = np.asarray(state.params["stack"]["layers"][0]["mlp"]["selection_bias"][...])
    steps = bias / 0.01  # three moves of -1, 0 or +1 each
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
    assert np.abs(bias).max() > 0 and np.abs(steps).max() <= 3 + 1e-4
    assert np.isfinite(metrics["loss"])


def test_restore_template_of_a_state_or_of_a_traced_builder():
    e, model, _ = _setup("gpt_char")
    state = initial_state(e, model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    built = []
    traced = restore_template(lambda: built.append(1) or initial_state(e, model), device)
    held = restore_template(state)
    assert built == [1] and jax.tree.structure(traced) == jax.tree.structure(held)
    for a, b, array in zip(jax.tree.leaves(traced), jax.tree.leaves(held),
                           jax.tree.leaves(state.to_dict()), strict=True):
        assert isinstance(a, jax.ShapeDtypeStruct) and (a.shape, a.dtype) == (b.shape, b.dtype)
        assert a.sharding == device and b.sharding == array.sharding
