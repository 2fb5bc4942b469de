"""Tests for the expert computation of tfx.ops.moe: the one-hot (GShard einsum) reference
against a per-token loop written out here, and the sorted and ragged dispatches against the
one-hot reference — values and gradients, over random shapes (hypothesis)."""

import dataclasses

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from kernel_cases import expert_weights

from tfx.ops.activations import ACTIVATIONS
from tfx.ops.moe import (
    IMPLEMENTATIONS,
    expert_parallel_moe,
    experts_ffn,
    grouped_matmul,
    moe,
    route,
)


def _case(seed, tokens, experts, k, d_model=6, d_ff=10, gated=True, capacity_factor=None):
    # numpy draws: jax.random would compile its sampler for each new shape hypothesis tries.
    rng = np.random.default_rng(seed)
    x, logits = (jnp.asarray(rng.standard_normal(shape, np.float32))
                 for shape in ((tokens, d_model), (tokens, experts)))
    routing = route(logits, num_selected=k, capacity_factor=capacity_factor)
    return x, routing, expert_weights(rng, experts, d_model, d_ff, gated)


def _per_token_loop(x, routing, weights, activation):
    """out[t] = Σ_j kept · weight · expert_{e}(x[t]), one token and choice at a time."""
    act = ACTIVATIONS[activation]
    x, w = np.asarray(x, np.float64), jax.tree.map(lambda a: np.asarray(a, np.float64), weights)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(routing.expert_ids.shape[1]):
            if not routing.kept[t, j]:
                continue
            e = int(routing.expert_ids[t, j])
            up = x[t] @ w.up[e]
            hidden = (np.asarray(act(up)) if w.gate is None
                      else np.asarray(act(x[t] @ w.gate[e])) * up)
            out[t] += float(routing.weights[t, j]) * (hidden @ w.down[e])
    return out


@pytest.mark.parametrize("gated, activation", [(True, "silu"), (False, "gelu")])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_onehot_reference_equals_the_per_token_loop(gated, activation, capacity_factor):
    x, routing, weights = _case(0, 16, 4, 2, gated=gated, capacity_factor=capacity_factor)
    if capacity_factor is not None:
        assert not routing.kept.all()  # the case does drop something
    out = experts_ffn(x, routing, weights, activation=activation, implementation="onehot")
    np.testing.assert_allclose(out, _per_token_loop(x, routing, weights, activation),
                               rtol=1e-5, atol=1e-6)


@settings(deadline=None, max_examples=15)
@given(tokens=st.integers(1, 24), experts=st.integers(1, 6), k=st.integers(1, 3),
       gated=st.booleans(), capacity_factor=st.sampled_from([None, 0.3, 1.0, 2.0]),
       block_size=st.sampled_from([1, 3, 8, 128]), seed=st.integers(0, 100))
def test_sorted_and_ragged_equal_onehot(tokens, experts, k, gated, capacity_factor, block_size,
                                        seed):
    k = min(k, experts)
    x, routing, weights = _case(seed, tokens, experts, k, gated=gated,
                                capacity_factor=capacity_factor)
    reference = experts_ffn(x, routing, weights, implementation="onehot")
    for implementation in ("sorted", "ragged"):
        out = experts_ffn(x, routing, weights, implementation=implementation,
                          block_size=block_size)
        chex.assert_trees_all_close(out, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["sorted", "ragged"])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_gradients_equal_onehot(implementation, capacity_factor):
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (20, 6))
    router = jax.random.normal(keys[1], (6, 5))
    weights = expert_weights(keys[2], 5, 6, 10)

    def loss(x, router, weights, implementation):
        out, routing = moe(x, router, weights, num_selected=2, capacity_factor=capacity_factor,
                           implementation=implementation, block_size=4)
        return jnp.sum(out**2) + routing.load_balancing_loss

    grads = jax.grad(loss, argnums=(0, 1, 2))(x, router, weights, implementation)
    expected = jax.grad(loss, argnums=(0, 1, 2))(x, router, weights, "onehot")
    chex.assert_trees_all_close(grads, expected, rtol=1e-4, atol=1e-5)
    assert np.abs(grads[1]).sum() > 0  # the router learns through the combine weights


def test_dropped_tokens_output_zero():
    # Every token wants expert 0 with capacity 2: tokens 2.. are dropped entirely.
    x = jax.random.normal(jax.random.key(2), (6, 4))
    logits = jnp.zeros((6, 3)).at[:, 0].set(10.0)
    routing = route(logits, num_selected=1, capacity_factor=1.0)
    weights = expert_weights(jax.random.key(3), 3, 4, 8)
    for implementation in IMPLEMENTATIONS:  # interpret: megablox runs on CPU; others ignore it
        out = experts_ffn(x, routing, weights, implementation=implementation, interpret=True)
        np.testing.assert_array_equal(out[2:], 0.0)
        assert np.abs(out[:2]).min() > 0


def test_bfloat16_compute():
    x, routing, weights = _case(4, 12, 4, 2)
    out = experts_ffn(x.astype(jnp.bfloat16), routing, weights)
    chex.assert_type(out, jnp.bfloat16)
    np.testing.assert_allclose(out.astype(np.float32), experts_ffn(x, routing, weights),
                               rtol=0.05, atol=0.05)


def test_grouped_matmul_equals_blockwise_products():
    keys = jax.random.split(jax.random.key(5), 3)
    lhs = jax.random.normal(keys[0], (5 * 4, 3))
    rhs = jax.random.normal(keys[1], (3, 3, 7))
    block_expert = jnp.asarray([0, 0, 2, 1, 1], jnp.int32)

    def naive(lhs, rhs):
        blocks = lhs.reshape(5, 4, 3)
        out = jnp.einsum("bik,bkn->bin", blocks, rhs[block_expert])
        return out.at[4].set(0.0).reshape(20, 7)  # blocks from used_blocks = 4 on are padding

    np.testing.assert_allclose(grouped_matmul(lhs, rhs, block_expert, jnp.int32(4)),
                               naive(lhs, rhs), rtol=1e-6)
    cotangent = jax.random.normal(keys[2], (20, 7))
    ours = jax.vjp(lambda a, b: grouped_matmul(a, b, block_expert, jnp.int32(4)), lhs, rhs)[1]
    theirs = jax.vjp(naive, lhs, rhs)[1]
    chex.assert_trees_all_close(ours(cotangent), theirs(cotangent), rtol=1e-5, atol=1e-6)


class TestBadInput:
    def test_weights_of_the_wrong_shape(self):
        x, routing, weights = _case(6, 8, 4, 2)
        with pytest.raises(ValueError, match=r"weights\.down"):
            experts_ffn(x, routing, dataclasses.replace(weights, down=weights.down[:, :, :3]))
        with pytest.raises(ValueError, match=r"weights\.gate"):
            experts_ffn(x, routing, dataclasses.replace(weights, gate=weights.gate[:3]))

    def test_routing_for_other_tokens(self):
        x, routing, weights = _case(7, 8, 4, 2)
        with pytest.raises(ValueError, match="routing covers 8 tokens"):
            experts_ffn(x[:5], routing, weights)

    def test_unknown_implementation_and_activation(self):
        x, routing, weights = _case(8, 8, 4, 2)
        with pytest.raises(ValueError, match="implementation"):
            experts_ffn(x, routing, weights, implementation="dense")
        with pytest.raises(ValueError, match="activation"):
            experts_ffn(x, routing, weights, activation="tanh")

    def test_router_kernel_of_the_wrong_width(self):
        x, _, weights = _case(9, 8, 4, 2)
        with pytest.raises(ValueError, match="router_kernel"):
            moe(x, jnp.zeros((5, 4)), weights, num_selected=2)


@pytest.mark.parametrize("options", [
    dict(policy="deepseek", num_selected=2, num_groups=4, groups_per_token=2, routed_scale=2.5),
    dict(policy="deepseek", num_selected=3, num_groups=2, groups_per_token=1, renormalize=False),
    dict(policy="topk", num_selected=2, renormalize=False, routed_scale=0.5),
])
def test_routing_options_reach_the_router(options):
    """moe and expert_parallel_moe (a mesh of one device) = route with the same options, then
    experts_ffn; the options must change the result (else the check proves nothing)."""
    x, _, weights = _case(30, 12, 8, 2)
    router = jax.random.normal(jax.random.key(31), (6, 8))
    bias = (jax.random.normal(jax.random.key(32), (8,))
            if options["policy"] == "deepseek" else None)
    routing = route(x @ router, selection_bias=bias, **options)
    expected = experts_ffn(x, routing, weights, implementation="onehot")
    out, ours = moe(x, router, weights, selection_bias=bias, implementation="onehot", **options)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ours.expert_ids, routing.expert_ids)
    mesh = jax.make_mesh((1,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    parallel, _ = expert_parallel_moe(x, router, weights, mesh=mesh, selection_bias=bias,
                                      **options)
    np.testing.assert_allclose(parallel, expected, rtol=1e-5, atol=1e-6)
    plain = {k: v for k, v in options.items()
             if k not in ("renormalize", "num_groups", "groups_per_token", "routed_scale")}
    default, _ = moe(x, router, weights, selection_bias=bias, implementation="onehot", **plain)
    assert np.abs(np.asarray(default) - np.asarray(expected)).max() > 1e-3
