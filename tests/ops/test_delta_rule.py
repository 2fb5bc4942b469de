"""The gated delta rule, chunked and token by token, against the per-token recurrence written
out here (values and gradients, float32 and bfloat16), and the short causal convolution
against its written-out sum and PyTorch's depthwise Conv1d."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops.linear_attention import causal_conv1d, gated_delta_recurrent, gated_delta_rule


def naive(q, k, v, g, beta, state=None, scale=None):
    """The recurrence of the module docstring, one token and one head at a time (jax.numpy, so
    that it differentiates too). Shapes as gated_delta_rule's."""
    batch, seq, key_heads, key_dim = q.shape
    heads = v.shape[2]
    q, k = (jnp.repeat(x, heads // key_heads, axis=2) for x in (q, k))
    scale = key_dim ** -0.5 if scale is None else scale
    if state is None:
        state = jnp.zeros((batch, heads, key_dim, v.shape[3]))
    outs = []
    for t in range(seq):
        state = state * jnp.exp(g[:, t])[..., None, None]
        recalled = jnp.einsum("bhk,bhkv->bhv", k[:, t], state)
        delta = (v[:, t] - recalled) * beta[:, t][..., None]
        state = state + k[:, t][..., :, None] * delta[..., None, :]
        outs.append(jnp.einsum("bhk,bhkv->bhv", scale * q[:, t], state))
    return jnp.stack(outs, axis=1), state


def inputs(seed, batch=2, seq=13, key_heads=1, heads=2, key_dim=8, value_dim=4,
           dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731 (as Qwen3-Next)
    q = unit(jax.random.normal(keys[0], (batch, seq, key_heads, key_dim)))
    k = unit(jax.random.normal(keys[1], (batch, seq, key_heads, key_dim)))
    v = jax.random.normal(keys[2], (batch, seq, heads, value_dim))
    g = -jax.random.uniform(keys[3], (batch, seq, heads), maxval=0.7)
    beta = jax.random.uniform(keys[4], (batch, seq, heads))
    state = jax.random.normal(keys[5], (batch, heads, key_dim, value_dim))
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta)), state


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 16])
def test_chunked_and_recurrent_equal_the_recurrence(chunk_size):
    args, state = inputs(0, key_heads=2, heads=4)
    want_out, want_state = naive(*args, state)
    out, final = gated_delta_rule(*args, initial_state=state, chunk_size=chunk_size)
    chex.assert_trees_all_close((out, final), (want_out, want_state), atol=2e-5, rtol=2e-5)
    out, final = gated_delta_recurrent(*args, initial_state=state)
    chex.assert_trees_all_close((out, final), (want_out, want_state), atol=2e-5, rtol=2e-5)


@settings(max_examples=8, deadline=None)
@given(seq=st.integers(1, 20), chunk=st.integers(1, 8), key_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), key_dim=st.integers(1, 6), value_dim=st.integers(1, 5))
def test_any_shape_equals_the_recurrence(seq, chunk, key_heads, group, key_dim, value_dim):
    args, _ = inputs(seq, batch=1, seq=seq, key_heads=key_heads, heads=key_heads * group,
                     key_dim=key_dim, value_dim=value_dim)
    got = gated_delta_rule(*args, chunk_size=chunk, scale=0.5)
    chex.assert_trees_all_close(got, naive(*args, scale=0.5), atol=2e-5, rtol=2e-5)


def test_gradients_equal_the_recurrence():
    args, state = inputs(1)

    def loss(fn):
        def value(*xs):
            out, final = fn(*xs)
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(final))
        return jax.grad(value, argnums=tuple(range(6)))(*args, state)

    want = loss(naive)
    chunked = loss(lambda *x: gated_delta_rule(*x[:5], initial_state=x[5], chunk_size=4))
    recurrent = loss(lambda *x: gated_delta_recurrent(*x[:5], initial_state=x[5]))
    chex.assert_trees_all_close(chunked, want, atol=5e-5, rtol=5e-5)
    chex.assert_trees_all_close(recurrent, want, atol=5e-5, rtol=5e-5)


def test_bfloat16_inputs_compute_in_float32():
    args, _ = inputs(2, dtype=jnp.bfloat16)
    want, _ = naive(*(x.astype(jnp.float32) for x in args))
    out, final = gated_delta_rule(*args, chunk_size=4)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    chex.assert_trees_all_close(out.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)


def test_a_prefill_then_decoding_steps_equal_the_whole_sequence():
    args, _ = inputs(3, seq=11)
    whole, whole_state = gated_delta_rule(*args, chunk_size=4)
    out, state = gated_delta_rule(*(x[:, :7] for x in args), chunk_size=4)
    outs = [out]
    for t in range(7, 11):
        out, state = gated_delta_recurrent(*(x[:, t:t + 1] for x in args), initial_state=state)
        outs.append(out)
    chex.assert_trees_all_close((jnp.concatenate(outs, axis=1), state), (whole, whole_state),
                                atol=2e-5, rtol=2e-5)


def test_bad_inputs_are_named():
    (q, k, v, g, beta), state = inputs(0)
    with pytest.raises(ValueError, match=r"query .* and key .* must be equal"):
        gated_delta_rule(q, k[:, :, :, :4], v, g, beta)
    (q2, k2, v2, g2, beta2), _ = inputs(0, key_heads=2, heads=4)
    with pytest.raises(ValueError, match=r"key_heads dividing the heads of value"):
        gated_delta_rule(q2, k2, v2[:, :, :3], g2[:, :, :3], beta2[:, :, :3])
    with pytest.raises(ValueError, match=r"beta must be \[batch, seq, heads\]"):
        gated_delta_recurrent(q, k, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match=r"initial_state must be \[batch, heads, key_dim"):
        gated_delta_rule(q, k, v, g, beta, initial_state=state[:, :1])
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1"):
        gated_delta_rule(q, k, v, g, beta, chunk_size=0)


def _conv_written_out(x, weight, state):
    taps = weight.shape[0]
    padded = np.concatenate([state, x], axis=1)
    return np.stack([sum(padded[:, t + i] * weight[i] for i in range(taps))
                     for t in range(x.shape[1])], axis=1)


def test_causal_conv_equals_its_sum_and_streams():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 9, 5)).astype(np.float32)
    weight = rng.normal(size=(4, 5)).astype(np.float32)
    state = rng.normal(size=(2, 3, 5)).astype(np.float32)
    y, final = causal_conv1d(x, weight, state=state)
    chex.assert_trees_all_close(y, _conv_written_out(x, weight, state), atol=1e-5)
    chex.assert_trees_all_close(final, np.concatenate([state, x], axis=1)[:, -3:])
    first, mid = causal_conv1d(x[:, :6], weight, state=state)
    rest, end = causal_conv1d(x[:, 6:], weight, state=mid)
    chex.assert_trees_all_close((jnp.concatenate([first, rest], 1), end), (y, final), atol=1e-6)
    with pytest.raises(ValueError, match=r"state must be \[batch, kernel_size - 1, channels\]"):
        causal_conv1d(x, weight, state=state[:, :2])


def test_causal_conv_equals_torch_depthwise_conv1d():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 7, 6)).astype(np.float32)
    weight = rng.normal(size=(4, 6)).astype(np.float32)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=False)
    conv.weight.data = torch.from_numpy(weight.T[:, None, :].copy())
    want = conv(torch.from_numpy(x).transpose(1, 2))[..., :7].transpose(1, 2).detach().numpy()
    chex.assert_trees_all_close(causal_conv1d(x, weight)[0], want, atol=1e-5)
