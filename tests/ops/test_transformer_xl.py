"""Tests for Transformer-XL relative attention (tfx.ops.positional.transformer_xl).

Reference: the paper's four-term score (Dai et al., 2019, section 3.3), written out here with an
explicit relative embedding R_{i-j} per (query, key) pair, and the sin/cos formula of R.
"""

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops.positional.transformer_xl import (
    transformer_xl_position_embeddings,
    transformer_xl_scores,
)


def relative_embedding(distance, dim):
    """R_distance = [sin(distance·w_0..w_{dim/2-1}) | cos(...)], w_i = 10000^(-2i/dim)."""
    freqs = 10000.0 ** (-np.arange(0, dim, 2) / dim)
    return np.concatenate([np.sin(distance * freqs), np.cos(distance * freqs)])


def written_out_scores(query, key, w_r, u, v):
    """score[b, h, i, j] = q·k_j + q·W_R R_{i-j} + u·k_j + v·W_R R_{i-j} for visible j, else nan."""
    batch, q_len, heads, head_dim = query.shape
    kv_len = key.shape[1]
    memory = kv_len - q_len
    out = np.full((batch, heads, q_len, kv_len), np.nan)
    for b, h, i, j in np.ndindex(out.shape):
        if j > i + memory:
            continue
        r = (relative_embedding(i + memory - j, w_r.shape[0]) @ w_r).reshape(heads, head_dim)[h]
        q, k = query[b, i, h], key[b, j, h]
        out[b, h, i, j] = q @ k + q @ r + u[h] @ k + v[h] @ r
    return out


def random_inputs(seed, batch, q_len, kv_len, heads, head_dim, d_model=8):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(batch, q_len, heads, head_dim))
    key = rng.normal(size=(batch, kv_len, heads, head_dim))
    w_r = rng.normal(size=(d_model, heads * head_dim)) / np.sqrt(d_model)
    u, v = rng.normal(size=(2, heads, head_dim))
    return query, key, w_r, u, v


def ours(fn, query, key, w_r, u, v):
    kv_len, heads, head_dim = key.shape[1:]
    r = transformer_xl_position_embeddings(kv_len, w_r.shape[0])
    position_keys = (r @ jnp.asarray(w_r, jnp.float32)).reshape(kv_len, heads, head_dim)
    args = (query, key, position_keys, u, v)
    return fn(*(jnp.asarray(a, jnp.float32) for a in args))


def assert_close_where_visible(actual, expected):
    visible = ~np.isnan(expected)
    np.testing.assert_allclose(np.asarray(actual)[visible], expected[visible], atol=1e-4)


class TransformerXLTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_position_embeddings_match_sin_cos_formula(self):
        fn = self.variant(functools.partial(transformer_xl_position_embeddings, 7, 6))
        out = fn()
        chex.assert_shape(out, (7, 6))
        chex.assert_type(out, jnp.float32)
        # Row r holds distance 6 - r: descending, the last row is distance 0.
        expected = np.stack([relative_embedding(6 - r, 6) for r in range(7)])
        np.testing.assert_allclose(out, expected, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("no_memory", 4, 4), ("memory", 3, 7), ("one_query", 1, 5)
    )
    def test_scores_match_written_out_formula(self, q_len, kv_len):
        # kv_len > q_len: the first kv_len - q_len keys are the memory of the previous segment.
        inputs = random_inputs(0, 2, q_len, kv_len, heads=3, head_dim=4)
        scores = ours(self.variant(transformer_xl_scores), *inputs)
        chex.assert_shape(scores, (2, 3, q_len, kv_len))
        chex.assert_type(scores, jnp.float32)
        assert_close_where_visible(scores, written_out_scores(*inputs))


@settings(max_examples=15, deadline=None)
@given(
    q_len=st.integers(1, 5),
    memory=st.integers(0, 4),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_scores_property(q_len, memory, heads, head_dim, seed):
    inputs = random_inputs(seed, 1, q_len, q_len + memory, heads, head_dim, d_model=4)
    assert_close_where_visible(ours(transformer_xl_scores, *inputs), written_out_scores(*inputs))


def test_low_precision_inputs_give_float32_scores():
    query = jnp.ones((1, 2, 2, 4), jnp.bfloat16)
    key = jnp.ones((1, 3, 2, 4), jnp.bfloat16)
    scores = transformer_xl_scores(query, key, key[0], query[0, 0], query[0, 0])
    chex.assert_type(scores, jnp.float32)
    chex.assert_shape(scores, (1, 2, 2, 3))


def bad_inputs(**overrides):
    inputs = dict(
        query=jnp.ones((2, 3, 4, 8)),
        key=jnp.ones((2, 5, 4, 8)),
        position_keys=jnp.ones((5, 4, 8)),
        u=jnp.ones((4, 8)),
        v=jnp.ones((4, 8)),
    )
    inputs.update(overrides)
    return inputs


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"key": jnp.ones((2, 5, 2, 8))}, ValueError, r"key of shape \(2, 5, 2, 8\) must be"),
        ({"key": jnp.ones((1, 5, 4, 8))}, ValueError, r"key of shape \(1, 5, 4, 8\) must be"),
        ({"key": jnp.ones((2, 2, 4, 8)), "position_keys": jnp.ones((2, 4, 8))}, ValueError,
         r"key length \(2\) must be >= query length \(3\)"),
        ({"position_keys": jnp.ones((4, 4, 8))}, ValueError,
         r"position_keys of shape \(4, 4, 8\) must be \[kv_len, heads, head_dim\] = \(5, 4, 8\)"),
        ({"u": jnp.ones((4, 7))}, ValueError, r"u of shape \(4, 7\) must be .* = \(4, 8\)"),
        ({"v": jnp.ones(8)}, ValueError, r"v must have 2 dims \[heads, head_dim\]"),
        ({"query": jnp.ones((2, 3, 4, 8), jnp.int32)}, TypeError,
         "query must have a floating dtype"),
        ({"query": jnp.ones((3, 4, 8))}, ValueError, "query must have 4 dims"),
    ],
)
def test_scores_bad_inputs(overrides, error, match):
    with pytest.raises(error, match=match):
        transformer_xl_scores(**bad_inputs(**overrides))


@pytest.mark.parametrize(
    ("kv_len", "dim", "error", "match"),
    [(0, 4, ValueError, "kv_len must be >= 1, got 0"), (3, 5, ValueError, "dim must be even"),
     (3.0, 4, TypeError, "kv_len must be an int")],
)
def test_position_embeddings_bad_arguments(kv_len, dim, error, match):
    with pytest.raises(error, match=match):
        transformer_xl_position_embeddings(kv_len, dim)
