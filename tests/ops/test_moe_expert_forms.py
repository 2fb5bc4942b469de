"""GPT-OSS's expert form in tfx.ops.moe: a router with a bias, experts with biases and the
clamped SwiGLU (`ClampedSwiGLU`). The one-hot reference against a per-token loop written out
here; every dispatch ("sorted", "ragged", "megablox" in interpret mode) and the expert-parallel
layer (one device here, four in a subprocess) against it, values and gradients; the checks."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import expert_weights

from tfx.ops.moe import (
    IMPLEMENTATIONS,
    ClampedSwiGLU,
    expert_parallel_moe,
    experts_ffn,
    moe,
    route,
)

TOKENS, D_MODEL, D_FF, EXPERTS = 12, 6, 10, 4
# A limit the random experts' gate and up values exceed, so that the clamps matter.
CLAMPED = ClampedSwiGLU(limit=0.4, alpha=1.702)


def _inputs(seed=0, d_ff=D_FF):
    """x [T, d], router kernel [d, E] and bias [E], and experts with biases of every kind."""
    keys = jax.random.split(jax.random.key(seed), 6)
    weights = dataclasses.replace(
        expert_weights(keys[0], EXPERTS, D_MODEL, d_ff, gated=True),
        gate_bias=0.3 * jax.random.normal(keys[1], (EXPERTS, d_ff)),
        up_bias=0.3 * jax.random.normal(keys[2], (EXPERTS, d_ff)),
        down_bias=0.3 * jax.random.normal(keys[3], (EXPERTS, D_MODEL)))
    return (2 * jax.random.normal(keys[4], (TOKENS, D_MODEL)),
            jax.random.normal(keys[5], (D_MODEL, EXPERTS)), 0.5 * jnp.arange(EXPERTS) - 1.0,
            weights)


def _written_out(x, kernel, bias, weights, k):
    """GPT-OSS's MLP one token at a time (float64): the top k of x·W + b, weighted by a softmax
    over those k logits; each expert gate_up = x·[gate | up] + biases, clamped, (u + 1) · g ·
    sigmoid(1.702 g), then down with its bias."""
    x, kernel, bias = (np.asarray(a, np.float64) for a in (x, kernel, bias))
    w = jax.tree.map(lambda a: np.asarray(a, np.float64), weights)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ kernel + bias
        top = np.argsort(-logits)[:k]
        gates = np.exp(logits[top] - logits[top].max())
        for e, g in zip(top, gates / gates.sum(), strict=True):
            gate = np.minimum(x[t] @ w.gate[e] + w.gate_bias[e], CLAMPED.limit)
            up = np.clip(x[t] @ w.up[e] + w.up_bias[e], -CLAMPED.limit, CLAMPED.limit)
            hidden = (up + 1) * gate / (1 + np.exp(-CLAMPED.alpha * gate))
            out[t] += g * (hidden @ w.down[e] + w.down_bias[e])
    return out


def _moe(x, kernel, bias, weights, implementation, k=2, **options):
    return moe(x, kernel, weights, num_selected=k, router_bias=bias, renormalize=True,
               activation=CLAMPED, implementation=implementation, interpret=True, **options)[0]


@pytest.mark.parametrize("k", [1, 2])
def test_onehot_equals_the_written_out_mlp(k):
    x, kernel, bias, weights = _inputs()
    gate = np.asarray(jnp.einsum("td,edf->tef", x, weights.gate) + weights.gate_bias[None])
    assert (gate > CLAMPED.limit).mean() > 0.2  # the clamp is exercised
    np.testing.assert_allclose(_moe(x, kernel, bias, weights, "onehot", k),
                               _written_out(x, kernel, bias, weights, k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", [i for i in IMPLEMENTATIONS if i != "onehot"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_every_dispatch_equals_onehot(implementation, capacity_factor):
    x, kernel, bias, weights = _inputs(1)
    options = dict(capacity_factor=capacity_factor, block_size=4)
    expected = _moe(x, kernel, bias, weights, "onehot", **options)
    chex.assert_trees_all_close(_moe(x, kernel, bias, weights, implementation, **options),
                                expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["sorted", "ragged"])
def test_gradients_equal_onehot(implementation):
    """Gradients of x, the router kernel and bias, and every expert weight and bias."""
    x, kernel, bias, weights = _inputs(2)
    cotangent = jax.random.normal(jax.random.key(9), x.shape)

    def loss(*args, implementation):
        return jnp.sum(_moe(*args, implementation, block_size=4) * cotangent)

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(x, kernel, bias, weights,
                                                 implementation=implementation)
    expected = jax.grad(loss, argnums=(0, 1, 2, 3))(x, kernel, bias, weights,
                                                    implementation="onehot")
    chex.assert_trees_all_close(grads, expected, rtol=1e-4, atol=1e-5)
    assert np.abs(grads[2]).sum() > 0 and np.abs(grads[3].down_bias).sum() > 0


def test_experts_without_hidden_units_output_their_down_bias():
    x, kernel, bias, weights = _inputs(3, d_ff=0)
    routing = route(x @ kernel + bias, num_selected=2)
    expected = jnp.einsum("tk,tkd->td", routing.weights, weights.down_bias[routing.expert_ids])
    for implementation in ("onehot", "sorted"):
        out = experts_ffn(x, routing, weights, activation=CLAMPED, implementation=implementation)
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_expert_parallel_on_one_device_equals_moe():
    x, kernel, bias, weights = _inputs(4)
    mesh = jax.make_mesh((1,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    out, _ = expert_parallel_moe(x, kernel, weights, mesh=mesh, num_selected=2,
                                 router_bias=bias, renormalize=True, activation=CLAMPED)
    np.testing.assert_allclose(out, _moe(x, kernel, bias, weights, "onehot"), rtol=1e-5,
                               atol=1e-5)


_FOUR_DEVICES = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                               + os.environ.get("XLA_FLAGS", ""))
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, numpy as np
    from test_moe_expert_forms import CLAMPED, _inputs, _moe
    from tfx.ops.moe import expert_parallel_moe
    assert jax.device_count() == 4
    x, kernel, bias, weights = _inputs(5)
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    out, _ = expert_parallel_moe(x, kernel, weights, mesh=mesh, num_selected=2,
                                 router_bias=bias, renormalize=True, activation=CLAMPED)
    np.testing.assert_allclose(out, _moe(x, kernel, bias, weights, "onehot"), rtol=1e-5,
                               atol=1e-5)
""")


def test_expert_parallel_over_four_devices_equals_moe():
    """Experts and their biases split over an expert axis of 4 CPU devices (dropless: every
    group's `moe` is the all-token one), in a subprocess that has them."""
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-c", _FOUR_DEVICES, here], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(here),
                          env={**os.environ, "JAX_PLATFORMS": "cpu",
                               "PYTHONPATH": os.pathsep.join([os.path.dirname(here),
                                                              os.environ.get("PYTHONPATH",
                                                                             "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]


class TestBadInput:
    def test_clamped_swiglu_needs_a_gate_and_a_finite_limit(self):
        x, kernel, _, weights = _inputs()
        routing = route(x @ kernel, num_selected=2)
        ungated = dataclasses.replace(weights, gate=None, gate_bias=None)
        with pytest.raises(ValueError, match="ClampedSwiGLU needs gated experts"):
            experts_ffn(x, routing, ungated, activation=CLAMPED)
        with pytest.raises(ValueError, match=r"ClampedSwiGLU\.limit must be finite"):
            ClampedSwiGLU(limit=float("inf"), alpha=1.0)

    def test_biases_of_the_wrong_shape(self):
        x, kernel, bias, weights = _inputs()
        routing = route(x @ kernel, num_selected=2)
        with pytest.raises(ValueError, match=r"weights\.down_bias must have shape \(4, 6\)"):
            experts_ffn(x, routing, dataclasses.replace(weights, down_bias=weights.up_bias))
        with pytest.raises(ValueError, match=r"weights\.gate_bias needs weights\.gate"):
            experts_ffn(x, routing, dataclasses.replace(weights, gate=None), activation="gelu")
        with pytest.raises(ValueError, match=r"router_bias must be \[num_experts\] = \(4,\)"):
            moe(x, kernel, weights, num_selected=2, router_bias=bias[:3])
