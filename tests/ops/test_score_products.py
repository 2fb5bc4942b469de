"""The score products of tfx.ops.attention.reference against the products written out with
numpy (values) and against autodiff of plain einsums (gradients), and the layout claims: no
transposed copy of the scores in the compiled backward, and none of the keys in
key_query_scores' forward."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compile_as_users_do
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops.attention.reference import key_query_scores, query_key_scores, weighted_values


def plain_scores(query, key):
    return jnp.einsum("bkgtd,bksd->bkgts", query, key, preferred_element_type=jnp.float32)


def plain_values(probs, value):
    return jnp.einsum("bkgts,bksd->bkgtd", probs, value)


def arrays(seed, batch, heads, group, q_len, kv_len, dim, dtype=np.float32):
    rng = np.random.default_rng(seed)
    shapes = ((batch, heads, group, q_len, dim), (batch, heads, kv_len, dim),
              (batch, heads, group, q_len, kv_len), (batch, heads, kv_len, dim))
    return [jnp.asarray(rng.standard_normal(s).astype(np.float32), dtype) for s in shapes]


def loss(scores_fn, values_fn, query, key, probs, value):
    """Both products in one scalar, with cotangents that are not all ones."""
    return (jnp.sum(jnp.sin(scores_fn(query, key)))
            + jnp.sum(jnp.cos(values_fn(probs, value).astype(jnp.float32))))


# Jitted: each hypothesis example's shapes compile once, rather than every op on its own.
@functools.partial(jax.jit, static_argnums=(0, 1))
def loss_gradients(scores_fn, values_fn, query, key, probs, value):
    """Gradients of `loss` for (query, key, probs, value)."""
    return jax.grad(functools.partial(loss, scores_fn, values_fn), (0, 1, 2, 3))(
        query, key, probs, value)


@functools.partial(jax.jit, static_argnums=0)
def sin_sum_gradients(scores_fn, query, key):
    """Gradients of sum(sin(scores)) for (query, key)."""
    return jax.grad(lambda q, k: jnp.sum(jnp.sin(scores_fn(q, k))), (0, 1))(query, key)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), group=st.integers(1, 3),
       q_len=st.integers(1, 9), kv_len=st.integers(1, 9), dim=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_values_and_gradients_equal_plain_einsums(batch, heads, group, q_len, kv_len, dim, seed):
    query, key, probs, value = arrays(seed, batch, heads, group, q_len, kv_len, dim)
    scores = jax.jit(query_key_scores)(query, key)
    chex.assert_shape(scores, (batch, heads, group, q_len, kv_len))
    q64, k64, p64, v64 = (np.asarray(x, np.float64) for x in (query, key, probs, value))
    chex.assert_trees_all_close(scores, np.einsum("bkgtd,bksd->bkgts", q64, k64),
                                atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(jax.jit(weighted_values)(probs, value),
                                np.einsum("bkgts,bksd->bkgtd", p64, v64), atol=1e-5, rtol=1e-5)
    grads = loss_gradients(query_key_scores, weighted_values, query, key, probs, value)
    expected = loss_gradients(plain_scores, plain_values, query, key, probs, value)
    chex.assert_trees_all_close(grads, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), group=st.integers(1, 3),
       q_len=st.integers(1, 4), kv_len=st.integers(1, 9), dim=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_key_query_scores_equal_the_scores_and_their_gradients(batch, heads, group, q_len,
                                                              kv_len, dim, seed):
    """The decoding product (few queries: q_len <= 4) against numpy and plain autodiff."""
    query, key = arrays(seed, batch, heads, group, q_len, kv_len, dim)[:2]
    scores = jax.jit(key_query_scores)(query, key)
    chex.assert_shape(scores, (batch, heads, group, q_len, kv_len))
    chex.assert_trees_all_close(
        scores, np.einsum("bkgtd,bksd->bkgts", *(np.asarray(x, np.float64) for x in (query, key))),
        atol=1e-5, rtol=1e-5)
    grads = sin_sum_gradients(key_query_scores, query, key)
    expected = sin_sum_gradients(plain_scores, query, key)
    chex.assert_trees_all_close(grads, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scores_fn", [query_key_scores, key_query_scores])
def test_bfloat16_keeps_dtypes_and_matches_autodiff(scores_fn):
    query, key, probs, value = arrays(0, 2, 2, 2, 8, 8, 4, jnp.bfloat16)
    chex.assert_type(scores_fn(query, key), jnp.float32)
    chex.assert_type(weighted_values(probs, value), jnp.bfloat16)
    argnums = (0, 1, 2, 3)
    grads = jax.grad(lambda *a: loss(scores_fn, weighted_values, *a), argnums)(
        query, key, probs, value)
    expected = jax.grad(lambda *a: loss(plain_scores, plain_values, *a), argnums)(
        query, key, probs, value)
    chex.assert_trees_all_equal_dtypes(grads, (query, key, probs, value))
    chex.assert_trees_all_close(jax.tree.map(lambda x: x.astype(jnp.float32), grads),
                                jax.tree.map(lambda x: x.astype(jnp.float32), expected),
                                atol=0.1, rtol=2e-2)  # bfloat16: 8 bits of mantissa


def score_sized_copies(scores_fn, values_fn, q_len=48, kv_len=40) -> list[str]:
    """The copies and transposes into a [.., S, T] array (the scores transposed) in the compiled
    backward of both products."""
    query, key, probs, value = arrays(0, 2, 2, 1, q_len, kv_len, 16)
    step = jax.jit(jax.grad(lambda *a: loss(scores_fn, values_fn, *a), (0, 1, 2, 3)))
    found = []
    hlo = compile_as_users_do(step.lower(query, key, probs, value)).as_text()
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = \w+\[([\d,]*)\]", line)
        if match and ("copy" in match.group(1) or "transpose" in match.group(1)):
            dims = [int(d) for d in match.group(2).split(",") if d]
            if dims[-2:] == [kv_len, q_len]:
                found.append(line.strip())
    return found


def test_backward_reads_scores_without_a_transposed_copy():
    assert score_sized_copies(query_key_scores, weighted_values) == []
    assert score_sized_copies(plain_scores, plain_values)  # what autodiff of einsums does


def transposed_keys(scores_fn, batch: int, heads: int, kv_len=192, dim=64) -> list[str]:
    """Instructions of the compiled scores of one decoding query that produce the keys
    transposed ([.., dim, kv_len])."""
    query, key = arrays(0, batch, heads, 1, 1, kv_len, dim)[:2]
    hlo = compile_as_users_do(jax.jit(scores_fn).lower(query, key)).as_text()
    return re.findall(rf"= f32\[(?:\d+,)*{dim},{kv_len}\]\S* \w+\(.*", hlo)


@pytest.mark.parametrize("batch,heads", [(1, 6), (8, 1), (1, 1), (8, 6)])
def test_key_query_scores_read_the_keys_as_stored(batch, heads):
    assert transposed_keys(key_query_scores, batch, heads) == []


def test_query_key_scores_transpose_the_keys_with_one_batch_dimension():
    """Why key_query_scores exists: XLA:CPU's Q·Kᵀ with one batch dimension left. Should a
    later XLA read the keys as stored here too, key_query_scores can go."""
    assert transposed_keys(query_key_scores, 1, 6)
    assert transposed_keys(query_key_scores, 8, 1)
    assert transposed_keys(query_key_scores, 8, 6) == []
