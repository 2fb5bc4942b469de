"""tfx.ops.sampling against the definitions of Hugging Face's logits warpers, written out here."""

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tfx.ops.sampling import filter_logits, sample_logits


def naive_top_k(logits, k):
    """HF TopKLogitsWarper: remove logits below the k-th largest."""
    kth = np.sort(logits, axis=-1)[:, ::-1][:, min(k, logits.shape[-1]) - 1]
    return np.where(logits < kth[:, None], -np.inf, logits)


def naive_top_p(logits, p):
    """HF TopPLogitsWarper: sort ascending, drop tokens whose cumulative probability <= 1 - p,
    always keeping the most likely one."""
    out = logits.copy()
    for row in range(logits.shape[0]):
        order = np.argsort(logits[row], kind="stable")
        probs = np.exp(logits[row][order] - logits[row].max())
        probs /= probs.sum()
        remove = np.cumsum(probs) <= 1 - p
        remove[-1] = False
        out[row, order[remove]] = -np.inf
    return out


# Distinct multiples of 0.01: no ties and no denormals (which XLA flushes to zero, making ties).
finite_logits = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(2, 40)),
                           elements=st.integers(-500, 500).map(lambda v: v / 100), unique=True)


@settings(max_examples=40, deadline=None)
@given(finite_logits, st.integers(1, 45))
def test_top_k_matches_definition(logits, k):
    np.testing.assert_array_equal(filter_logits(jnp.asarray(logits), top_k=jnp.int32(k)),
                                  naive_top_k(logits, k))


@settings(max_examples=40, deadline=None)
@given(finite_logits, st.floats(0.01, 1.0))
def test_top_p_matches_definition(logits, p):
    # A cumulative probability within float32 rounding of p may be decided either way.
    probs = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=np.float64)
    cumulative = np.cumsum(-np.sort(-probs / probs.sum(axis=1, keepdims=True)), axis=1)
    assume(np.abs(cumulative - p).min() > 1e-5)
    got = np.asarray(filter_logits(jnp.asarray(logits), top_p=jnp.float32(p)))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(naive_top_p(logits, np.float32(p))))


def test_top_k_then_top_p_in_hf_order():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], np.float32))
    # top_k=3 renormalises to 4/9, 3/9, 2/9; top_p=0.7 then needs the first two.
    got = filter_logits(jnp.asarray(logits), top_k=jnp.int32(3), top_p=jnp.float32(0.7))
    np.testing.assert_array_equal(np.isfinite(got), [[True, True, False, False]])


def test_greedy_when_temperature_zero_or_no_rng():
    logits = jax.random.normal(jax.random.key(0), (4, 11))
    greedy = jnp.argmax(logits, axis=-1)
    chex.assert_trees_all_equal(sample_logits(logits, None, temperature=1.0), greedy)
    chex.assert_trees_all_equal(
        sample_logits(logits, jax.random.key(1), temperature=0.0, top_p=jnp.float32(0.5)), greedy)
    chex.assert_trees_all_equal(
        sample_logits(logits, jax.random.key(1), temperature=1.0, top_k=jnp.int32(1)), greedy)


def test_sampling_frequencies_follow_tempered_softmax():
    logits = jnp.log(jnp.array([0.5, 0.25, 0.15, 0.1]))
    temperature = 2.0
    rows = jnp.tile(logits, (20000, 1))
    tokens = sample_logits(rows, jax.random.key(3), temperature=temperature)
    freq = np.bincount(np.asarray(tokens), minlength=4) / tokens.size
    expected = np.asarray(jax.nn.softmax(logits / temperature))
    np.testing.assert_allclose(freq, expected, atol=0.015)
    # With top_k=2 only the two most likely tokens appear, renormalised.
    tokens = sample_logits(rows, jax.random.key(4), temperature=1.0, top_k=jnp.int32(2))
    freq = np.bincount(np.asarray(tokens), minlength=4) / tokens.size
    np.testing.assert_allclose(freq, [2 / 3, 1 / 3, 0, 0], atol=0.015)


def test_rejects_bad_logits():
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        filter_logits(jnp.zeros((2, 3, 4)), top_k=jnp.int32(1))
    with pytest.raises(TypeError, match="logits"):
        sample_logits(jnp.zeros((2, 3), jnp.int32), None, temperature=0.0)
