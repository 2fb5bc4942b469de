"""Tests for ALiBi (tfx.ops.positional.alibi).

References: the slopes published in the paper (REFERENCES.md), BLOOM's build_alibi_tensor from
Hugging Face transformers (torch), and the bias formula written out here.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops.positional.alibi import alibi_bias, alibi_slopes


def test_published_slopes_for_8_heads():
    np.testing.assert_allclose(alibi_slopes(8), [2.0**-k for k in range(1, 9)], rtol=1e-7)


def test_published_slopes_for_12_heads():
    # The 8-head slopes, then every other slope of the 16-head set.
    expected = [2.0**-k for k in range(1, 9)] + [0.7071, 0.3536, 0.1768, 0.0884]
    np.testing.assert_allclose(alibi_slopes(12), expected, atol=1e-4)


@pytest.mark.parametrize("num_heads", [1, 2, 4, 16, 32])
def test_power_of_two_slopes_are_geometric(num_heads):
    # slope_h = 2^(-8(h+1)/n), written out.
    expected = [2.0 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)]
    out = alibi_slopes(num_heads)
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, expected, rtol=1e-7)


def bloom_alibi(num_heads, seq_len):
    """BLOOM's bias slope·j for every key j, as [heads, 1, seq_len] numpy."""
    torch = pytest.importorskip("torch")
    modeling_bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    mask = torch.ones(1, seq_len, dtype=torch.long)
    return modeling_bloom.build_alibi_tensor(mask, num_heads, torch.float32).numpy()


@pytest.mark.parametrize("num_heads", [*range(1, 21), 24, 40, 64, 80])
def test_slopes_match_bloom(num_heads):
    # BLOOM's bias at key 1 is its slope.
    np.testing.assert_allclose(
        alibi_slopes(num_heads), bloom_alibi(num_heads, 2)[:, 0, 1], rtol=1e-6
    )


@pytest.mark.parametrize("num_heads", [4, 12])
def test_causal_softmax_matches_bloom(num_heads):
    # BLOOM adds slope·j, which differs from -slope·(i - j) by slope·i, constant per query row,
    # so softmax over the keys a causal query sees is the same.
    seq_len = 7
    scores = np.random.default_rng(0).normal(size=(num_heads, seq_len, seq_len)).astype(np.float32)
    causal = np.tril(np.ones((seq_len, seq_len), bool))
    positions = jnp.arange(seq_len)
    ours = alibi_bias(alibi_slopes(num_heads), positions, positions)

    def causal_softmax(logits):
        return jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)

    chex.assert_trees_all_close(
        causal_softmax(scores + ours),
        causal_softmax(scores + bloom_alibi(num_heads, seq_len)),
        atol=1e-6,
    )


class AlibiBiasTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_written_out_formula(self):
        # bias[h, i, j] = -slope_h·|q_i - k_j|; queries 5, 6 decoding after a 5-token cache.
        slopes = np.array([0.5, 0.25, 0.125], np.float32)
        query, key = np.array([5, 6]), np.arange(9)
        bias = self.variant(alibi_bias)(jnp.asarray(slopes), jnp.asarray(query), jnp.asarray(key))
        chex.assert_shape(bias, (3, 2, 9))
        chex.assert_type(bias, jnp.float32)
        expected = np.zeros((3, 2, 9), np.float32)
        for h, i, j in np.ndindex(expected.shape):
            expected[h, i, j] = -slopes[h] * abs(query[i] - key[j])
        np.testing.assert_array_equal(bias, expected)

    @chex.variants(with_jit=True, without_jit=True)
    def test_batched_positions(self):
        slopes = jnp.array([0.5, 0.0625], jnp.bfloat16)
        query = np.array([[0, 1, 2], [3, 4, 5]])
        key = np.array([[0, 1, 2, 3], [2, 3, 4, 5]])
        bias = self.variant(alibi_bias)(slopes, jnp.asarray(query), jnp.asarray(key))
        chex.assert_shape(bias, (2, 2, 3, 4))
        chex.assert_type(bias, jnp.float32)
        expected = np.zeros((2, 2, 3, 4), np.float32)
        for b, h, i, j in np.ndindex(expected.shape):
            expected[b, h, i, j] = -float(slopes[h]) * abs(query[b, i] - key[b, j])
        np.testing.assert_array_equal(bias, expected)


@pytest.mark.parametrize(
    ("num_heads", "error", "match"),
    [(0, ValueError, "num_heads must be >= 1, got 0"), (8.0, TypeError, "num_heads must be an int"),
     (True, TypeError, "num_heads must be an int")],
)
def test_slopes_bad_arguments(num_heads, error, match):
    with pytest.raises(error, match=match):
        alibi_slopes(num_heads)


@pytest.mark.parametrize(
    ("slopes", "query", "error", "match"),
    [
        (jnp.ones(2, jnp.int32), jnp.arange(3), TypeError, "slopes must have a floating dtype"),
        (jnp.ones((2, 1)), jnp.arange(3), ValueError, r"slopes must have 1 dims \[heads\]"),
        (jnp.ones(2), jnp.arange(3.0), TypeError, "query_positions must have an integer dtype"),
    ],
)
def test_bias_bad_arguments(slopes, query, error, match):
    with pytest.raises(error, match=match):
        alibi_bias(slopes, query, jnp.arange(3))
