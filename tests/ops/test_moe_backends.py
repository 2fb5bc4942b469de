"""MoE backends by platform: the selection table (platform names faked), the megablox `gmm`
kernel in Pallas interpret mode against the one-hot reference (values and gradients), and the
errors for an implementation this platform cannot run.

"Unavailable" means: megablox compiles for TPU only, so elsewhere it needs interpret=True, and
the kernel takes float32 or bfloat16 only; the "ragged" exchange needs ragged_all_to_all
(GPU/TPU, tests/parallel/test_ragged_expert_parallel.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import expert_weights

from tfx.models.config import TransformerConfig
from tfx.ops.moe import (
    dispatch,
    experts_ffn,
    moe,
    route,
    select_expert_all_to_all,
    select_grouped_matmul,
)
from tfx.ops.moe.megablox import grouped_matmul_megablox


@pytest.mark.parametrize("platform, matmul, exchange", [
    ("cpu", "sorted", "fixed"),
    ("gpu", "ragged", "ragged"),
    ("cuda", "ragged", "ragged"),
    ("rocm", "ragged", "ragged"),
    ("tpu", "megablox", "ragged"),
    ("TPU", "megablox", "ragged"),
    ("METAL", "sorted", "fixed"),  # a plugin platform: the portable paths
])
def test_selection_by_platform(platform, matmul, exchange):
    assert select_grouped_matmul(platform) == matmul
    assert select_expert_all_to_all(platform) == exchange


def test_selection_needs_a_platform_name():
    with pytest.raises(TypeError, match="platform must be a platform name"):
        select_grouped_matmul(None)



def _case(tokens=40, experts=4, k=2, d_model=16, d_ff=32, gated=True, capacity_factor=None):
    keys = jax.random.split(jax.random.key(tokens), 3)
    x = jax.random.normal(keys[0], (tokens, d_model))
    router = jax.random.normal(keys[1], (d_model, experts))
    return x, router, expert_weights(keys[2], experts, d_model, d_ff, gated)


@pytest.mark.parametrize("platform, primitive", [
    ("gpu", "ragged_dot"), ("tpu", "pallas_call"), ("cpu", "while")])
def test_default_implementation_follows_the_platform(monkeypatch, platform, primitive):
    monkeypatch.setattr(dispatch, "current_platform", lambda: platform)
    x, router, weights = _case()
    routing = route(x @ router, num_selected=2)
    # Unjitted, so that the platform is read at this trace (jit would reuse an earlier one).
    jaxpr = str(jax.make_jaxpr(lambda x: dispatch.experts_ffn.__wrapped__(
        x, routing, weights, implementation=None))(x))
    others = {"ragged_dot", "pallas_call", "while"} - {primitive}
    assert primitive in jaxpr and not any(p in jaxpr for p in others)


# Row tile 16 with 40 tokens x 2 choices: groups start and end inside tiles, several tiles per
# group; with the capacity some assignments are dropped (rows after the groups are padding).
@pytest.mark.parametrize("gated, activation, capacity_factor", [
    (True, "silu", None), (False, "gelu", 0.75)])
def test_megablox_values_and_gradients_equal_onehot(gated, activation, capacity_factor):
    x, router, weights = _case(gated=gated)
    kwargs = dict(num_selected=2, capacity_factor=capacity_factor, activation=activation)

    def loss(implementation, x, router, weights):
        out, _ = moe(x, router, weights, implementation=implementation, block_size=16,
                     interpret=True, **kwargs)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)
    (_, out), grads = grad("megablox", x, router, weights)
    (_, ref), ref_grads = grad("onehot", x, router, weights)
    chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(out)).min(axis=1).max() > 0  # not a vacuous zero output
    if capacity_factor is not None:
        routing = route(x @ router, num_selected=2, capacity_factor=capacity_factor)
        assert not bool(routing.kept.all())


def test_megablox_bfloat16():
    x, router, weights = _case()
    routing = route(x @ router, num_selected=2)
    out = experts_ffn(x.astype(jnp.bfloat16), routing, weights, implementation="megablox",
                      block_size=16, interpret=True)
    chex.assert_type(out, jnp.bfloat16)
    ref = experts_ffn(x, routing, weights, implementation="onehot")
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=0.05, atol=0.05)


def test_megablox_rows_after_the_groups_are_zero_with_zero_gradient():
    lhs = jax.random.normal(jax.random.key(0), (20, 8))
    rhs = jax.random.normal(jax.random.key(1), (3, 8, 12))
    sizes = jnp.array([4, 0, 9], jnp.int32)

    def f(lhs):
        return grouped_matmul_megablox(lhs, rhs, sizes, tile_rows=8, interpret=True)

    out, d_lhs = jax.jit(lambda lhs: (f(lhs), jax.grad(lambda a: f(a).sum())(lhs)))(lhs)
    np.testing.assert_allclose(out[:13], jax.lax.ragged_dot(lhs, rhs, sizes)[:13], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(out[13:], 0.0)
    np.testing.assert_array_equal(d_lhs[13:], 0.0)
    assert np.isfinite(np.asarray(d_lhs)).all()


@pytest.mark.parametrize("platform, dtype, interpret, message", [
    ("cpu", jnp.float32, False,
     r"implementation='megablox' compiles for TPU only, but the platform is 'cpu'; pass "
     r"interpret=True"),
    ("gpu", jnp.float32, False, r"compiles for TPU only, but the platform is 'gpu'"),
    ("tpu", jnp.float16, False, r"implementation='megablox' needs x of dtype float32 or "
                                r"bfloat16, got float16"),
    ("cpu", jnp.float16, True, r"needs x of dtype float32 or bfloat16, got float16"),
])
def test_unavailable_megablox_raises(monkeypatch, platform, dtype, interpret, message):
    monkeypatch.setattr(dispatch, "current_platform", lambda: platform)
    x, router, weights = _case()
    routing = route(x @ router, num_selected=2)
    with pytest.raises(ValueError, match=message):
        experts_ffn(x.astype(dtype), routing, weights, implementation="megablox",
                    interpret=interpret)


def test_unknown_implementation_raises():
    x, router, weights = _case()
    with pytest.raises(ValueError, match=r"implementation must be None or one of \('sorted', "
                                         r"'onehot', 'ragged', 'megablox'\), got 'dense'"):
        experts_ffn(x, route(x @ router, num_selected=2), weights, implementation="dense")


def test_config_dispatch_defaults_to_the_platform():
    small = dict(vocab_size=8, d_model=8, num_layers=1, num_heads=2, d_ff=8)
    assert TransformerConfig(**small, moe={"num_experts": 2}).moe.dispatch is None
    moe = {"num_experts": 2, "dispatch": "megablox"}
    assert TransformerConfig(**small, moe=moe).moe.dispatch == "megablox"
