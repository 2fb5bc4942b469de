"""The two products of materialised-scores attention, with a backward pass that reads the
[T, S] matrices in the layout they are stored in.

Autodiff of `scores = Q Kᵀ` and `out = P V` gives dK = dSᵀ Q and dV = Pᵀ dO: products that
contract the query axis of dS and P, which is their major axis. XLA:CPU's matmuls want it minor
on the left operand, so it first copies each [T, S] matrix transposed: two copies the size of
the scores per layer, which in a 6-layer/384 GPT's training step at T = 255 took more time
than the matmuls they fed (an xprof profile of benchmarks/train.py). Here the same gradients are
computed transposed, dKᵀ = Qᵀ dS and dVᵀ = dOᵀ P, where dS and P are the right operand
contracted over their major axis (the layout a matmul reads without a copy); only the small
[S, D] results are transposed back.

Arrays use grouped heads: query [B, K, G, T, D] (K key/value heads, G query heads per key
head), key and value heads-major [B, K, S, D]. Both products are `jax.custom_vjp`: reverse-mode
only, as the blocked kernel's.

`key_query_scores` is the decoding counterpart of `query_key_scores`: the same scores for a few
queries over a long KV cache, computed with the cache as the left operand (plain autodiff).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["key_query_scores", "query_key_scores", "weighted_values"]


@jax.custom_vjp
def query_key_scores(query: jax.Array, key: jax.Array) -> jax.Array:
    """float32 [B, K, G, T, S] = query [B, K, G, T, D] · key [B, K, S, D]ᵀ."""
    return jnp.einsum("bkgtd,bksd->bkgts", query, key, preferred_element_type=jnp.float32)


def _scores_forward(query, key):
    return query_key_scores(query, key), (query, key)


def _scores_backward(residuals, d_scores):
    query, key = residuals
    d_query = jnp.einsum("bkgts,bksd->bkgtd", d_scores, key.astype(jnp.float32))
    d_key = _transposed_product(query.astype(jnp.float32), d_scores)
    return d_query.astype(query.dtype), d_key.astype(key.dtype)


query_key_scores.defvjp(_scores_forward, _scores_backward)


def key_query_scores(query: jax.Array, key: jax.Array) -> jax.Array:
    """float32 [B, K, G, T, S], the scores of `query_key_scores`, computed as key [S, D] ·
    queryᵀ [D, G·T] per head and then transposed.

    For a few queries over a long cache (decoding). When the product has one batch dimension
    left after XLA drops the size-1 ones (batch 1, or one KV head), XLA:CPU copies the key
    operand of Q·Kᵀ transposed, the whole [S, D] cache of every layer at every step; as the left
    operand of K·Qᵀ it is read as stored, and only the small [S, G·T] result is transposed
    (a free reshape when G·T = 1). Plain autodiff: no custom VJP.
    """
    batch, heads, group, q_len, dim = query.shape
    rows = query.reshape(batch, heads, group * q_len, dim)
    scores = jax.lax.dot_general(key, rows, (((3,), (3,)), ((0, 1), (0, 1))),
                                 preferred_element_type=jnp.float32)
    return jnp.swapaxes(scores, 2, 3).reshape(batch, heads, group, q_len, key.shape[2])


@jax.custom_vjp
def weighted_values(probs: jax.Array, value: jax.Array) -> jax.Array:
    """[B, K, G, T, Dv] = probs [B, K, G, T, S] · value [B, K, S, Dv], in value's dtype (probs
    must have it too)."""
    return jnp.einsum("bkgts,bksd->bkgtd", probs, value)


def _values_forward(probs, value):
    return weighted_values(probs, value), (probs, value)


def _values_backward(residuals, d_out):
    probs, value = residuals
    d_probs = jnp.einsum("bkgtd,bksd->bkgts", d_out, value)
    return d_probs, _transposed_product(d_out, probs).astype(value.dtype)


weighted_values.defvjp(_values_forward, _values_backward)


def _transposed_product(left: jax.Array, matrix: jax.Array) -> jax.Array:
    """[B, K, S, D] = Σ over (G, T) of matrix[b, k, g, t, s] · left[b, k, g, t, d], computed as
    (leftᵀ · matrix)ᵀ so that `matrix` [B, K, G, T, S] is read in its stored layout."""
    batch, heads, group, q_len, dim = left.shape
    rows = group * q_len
    flat_left = left.reshape(batch, heads, rows, dim)
    flat_matrix = matrix.reshape(batch, heads, rows, matrix.shape[-1])
    product = jax.lax.dot_general(flat_left, flat_matrix, (((2,), (2,)), ((0, 1), (0, 1))))
    return jnp.swapaxes(product, 2, 3)
