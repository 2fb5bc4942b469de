"""Attention logit soft-capping (Gemma 2: s = softcap·tanh(scale·q·k / softcap), then bias and
mask): every kernel that takes `softcap` against the formula written out below, in values and
in gradients; the kernels that cannot cap are never chosen for it; bad values are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops import backends, dot_product_attention, sparse
from tfx.ops.attention import cached_attention
from tfx.ops.attention.context_parallel import context_parallel_attention

SCALE, SOFTCAP = 0.7, 2.0  # scaled scores of std ~3: the cap bends most of them


def _naive(query, key, value, *, softcap, bias=None, visible=None):
    """The definition, dense in float32 jnp (so jax.grad differentiates it), K/V heads repeated:
    scores, tanh cap, bias, mask, softmax. Every row must see a key."""
    group = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (key, value))
    scores = jnp.einsum("bthd,bshd->bhts", query.astype(jnp.float32), key) * SCALE
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if visible is not None:
        scores = jnp.where(visible, scores, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), value)


def _inputs(q_len, kv_len, heads, dtype=jnp.float32, head_dim=16, batch=2):
    keys = jax.random.split(jax.random.key(q_len * 100 + kv_len), 4)
    query = jax.random.normal(keys[0], (batch, q_len, heads[0], head_dim), dtype)
    key, value = (jax.random.normal(k, (batch, kv_len, heads[1], head_dim), dtype)
                  for k in keys[1:3])
    cotangent = jax.random.normal(keys[3], (batch, q_len, heads[0], head_dim))
    return query, key, value, cotangent


def _case(name):
    """(inputs, dot_product_attention keywords, the naive formula's bias and visibility)."""
    if name == "causal_gqa":  # 40 = 3 tiles of 16 (the last one padded) each way
        inputs = _inputs(40, 40, (4, 2))
        return inputs, dict(is_causal=True), None, np.tril(np.ones((40, 40), bool))
    if name == "cross":
        return _inputs(24, 50, (2, 2)), {}, None, None
    # MQA, a sliding window, a mask over queries and keys (its diagonal kept, so every row
    # sees a key) and a bias that the blocked kernel's d bias must get before the cap's slope.
    inputs = _inputs(36, 36, (4, 1))
    rng = np.random.default_rng(0)
    mask = (rng.random((2, 1, 36, 36)) < 0.7) | np.eye(36, dtype=bool)
    bias = jnp.asarray(rng.normal(size=(1, 4, 36, 36)), jnp.float32)
    visible = mask & sparse.SlidingWindow(9).dense(36, 36)
    return inputs, dict(sparsity=sparse.SlidingWindow(9), mask=jnp.asarray(mask)), bias, visible


def _values_and_grads(attend, inputs, bias):
    """attend(q, k, v, bias) and the gradients of sum(out · cotangent) w.r.t. q, k, v, bias,
    in one jitted program."""
    query, key, value, cotangent = inputs

    def loss(q, k, v, b):
        out = attend(q, k, v, b)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(query, key, value,
                                                                              bias)
    return out, grads


@pytest.mark.parametrize("name", ["causal_gqa", "window_mask_bias_mqa", "cross"])
@pytest.mark.parametrize("implementation", ["reference", "blocked"])
def test_values_and_gradients_match_the_formula(implementation, name):
    inputs, kwargs, bias, visible = _case(name)
    found = _values_and_grads(lambda q, k, v, b: dot_product_attention(
        q, k, v, bias=b, scale=SCALE, softcap=SOFTCAP, implementation=implementation,
        block_sizes=(8, 16), **kwargs), inputs, bias)
    expected = _values_and_grads(lambda q, k, v, b: _naive(
        q, k, v, softcap=SOFTCAP, bias=b, visible=visible), inputs, bias)
    uncapped = _naive(*inputs[:3], softcap=None, bias=bias, visible=visible)
    assert np.abs(expected[0] - uncapped).max() > 0.1  # the cap matters in this case
    np.testing.assert_allclose(found[0], expected[0], atol=2e-5, rtol=2e-5)
    for part, got, want in zip(("dq", "dk", "dv", "dbias"), found[1], expected[1], strict=True):
        if want is not None:
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=part)


@pytest.mark.parametrize("implementation", ["reference", "blocked"])
def test_bfloat16(implementation):
    """bfloat16 inputs: scores, cap and softmax in float32, outputs rounded to bfloat16."""
    inputs = _inputs(40, 40, (4, 2), jnp.bfloat16)
    found = _values_and_grads(lambda q, k, v, _: dot_product_attention(
        q, k, v, is_causal=True, scale=SCALE, softcap=SOFTCAP, implementation=implementation,
        block_sizes=(16, 16)), inputs, None)
    expected = _values_and_grads(lambda q, k, v, _: _naive(
        q, k, v, softcap=SOFTCAP, visible=np.tril(np.ones((40, 40), bool))), inputs, None)
    assert found[0].dtype == jnp.bfloat16
    for got, want in zip((found[0], *found[1][:3]), (expected[0], *expected[1][:3]),
                         strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max(), rtol=3e-2)


def test_cached_attention_caps_as_the_reference():
    """The decoding path (keys heads-major in a cache) caps as training does."""
    query, key, value, _ = _inputs(3, 20, (4, 2))
    mask = jnp.asarray(np.arange(20) < 17)[None, None, None, :]  # 17 keys cached so far
    found = cached_attention(query, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3),
                             mask=mask, scale=SCALE, softcap=SOFTCAP)
    expected = _naive(query, key, value, softcap=SOFTCAP, visible=mask)
    np.testing.assert_allclose(found, expected, atol=2e-5, rtol=2e-5)


def test_context_parallel_caps_in_forward_and_backward():
    """Context parallelism's chunk pairs (blocked forward and backward) on a one-device ring."""
    inputs = _inputs(32, 32, (4, 2))
    mesh = jax.make_mesh((1,), ("sequence",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))  # as tfx.parallel's meshes
    with jax.set_mesh(mesh):
        found = _values_and_grads(lambda q, k, v, _: context_parallel_attention(
            q, k, v, mesh=mesh, spec=sparse.Causal(), scale=SCALE, softcap=SOFTCAP,
            block_sizes=(8, 8)), inputs, None)
    expected = _values_and_grads(lambda q, k, v, _: _naive(
        q, k, v, softcap=SOFTCAP, visible=np.tril(np.ones((32, 32), bool))), inputs, None)
    for got, want in zip((found[0], *found[1][:3]), (expected[0], *expected[1][:3]),
                         strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_splash_caps_in_interpret_mode():
    """TPU splash's attn_logits_soft_cap, run by the Pallas interpreter (slow: ~3 s)."""
    inputs = _inputs(128, 128, (2, 1), head_dim=64, batch=1)
    kwargs = dict(is_causal=True, scale=SCALE, softcap=SOFTCAP)
    found = _values_and_grads(lambda q, k, v, _: dot_product_attention(
        q, k, v, implementation="splash", **kwargs), inputs, None)
    expected = _values_and_grads(lambda q, k, v, _: dot_product_attention(
        q, k, v, implementation="reference", **kwargs), inputs, None)
    for got, want in zip((found[0], *found[1][:3]), (expected[0], *expected[1][:3]),
                         strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# Calls that cuDNN or the Pallas GPU kernel would take without a cap (see test_backends.py).
GPU_CASES = [backends.AttentionCase(dtype=dtype, q_len=1024, kv_len=1024, num_heads=8,
                                    num_kv_heads=2, head_dim=128, value_dim=128, spec=spec)
             for dtype in (jnp.bfloat16, jnp.float32) for spec in (None, sparse.Causal())]


@pytest.mark.parametrize("case", GPU_CASES)
def test_selection_never_picks_a_kernel_that_cannot_cap(case):
    if not jax.config.jax_enable_x64:  # which x64 keeps from the Pallas GPU kernel
        assert backends.select_attention("gpu", case) in ("cudnn", "pallas_gpu")
    capped = dataclasses.replace(case, has_softcap=True)
    assert backends.select_attention("gpu", capped) == "blocked"
    small = dataclasses.replace(capped, q_len=128, kv_len=128)
    assert backends.select_attention("gpu", small) == "reference"  # as uncapped small calls
    for kernel in ("cudnn", "pallas_gpu"):
        assert "no softcap (got one)" in backends.attention_unavailable(kernel, "gpu", capped)


def test_the_other_kernels_take_a_cap():
    case = dataclasses.replace(GPU_CASES[1], has_softcap=True)
    assert backends.select_attention("tpu", case) == "splash"
    assert backends.select_attention("cpu", case) == "blocked"
    split = dataclasses.replace(case, sequence_devices=4)
    assert backends.select_attention("gpu", split) == "context_parallel"


@pytest.mark.parametrize("implementation", ["cudnn", "pallas_gpu"])
def test_forcing_a_kernel_that_cannot_cap_raises(implementation):
    query, key, value, _ = _inputs(128, 128, (2, 2))
    with pytest.raises(ValueError, match=rf"'{implementation}' cannot run.*no softcap"):
        dot_product_attention(query, key, value, softcap=SOFTCAP, implementation=implementation)


@pytest.mark.parametrize(("softcap", "error", "message"), [
    (0.0, ValueError, "softcap must be > 0, got 0.0"),
    (-30.0, ValueError, "softcap must be > 0"),
    (float("inf"), ValueError, "softcap must be finite, got inf"),
    (float("nan"), ValueError, "softcap must be > 0, got nan"),
    ("30", TypeError, "softcap must be a number"),
    (True, TypeError, "softcap must be a number"),
])
def test_bad_softcap_is_refused(softcap, error, message):
    query, key, value, _ = _inputs(4, 4, (2, 1))
    with pytest.raises(error, match=message):
        dot_product_attention(query, key, value, softcap=softcap)
    with pytest.raises(error, match=message):  # the decoding path: keys heads-major
        dot_product_attention(query, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3),
                              softcap=softcap, heads_major=True)
    with pytest.raises(error, match=message):
        context_parallel_attention(query, key, value, softcap=softcap,
                                   mesh=jax.sharding.AbstractMesh((1,), ("sequence",)))

