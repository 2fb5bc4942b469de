"""Materialised-scores attention: the reference kernel and the two products it is made of.

The reference kernel materialises the [batch, heads, q_len, kv_len] scores. It is the
definition every faster kernel is tested against, and the maths of
`tfx.ops.attention.cached_attention` (the few queries of a decoding step over a heads-major
cache).

The products (`query_key_scores`, `weighted_values`) have a backward pass that reads the
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
import numpy as np

from tfx.ops.activations import softcap as soft_cap
from tfx.ops.attention.kernel import Call, Kernel
from tfx.ops.masks import combine_masks, segment_mask

__all__ = ["KERNEL", "key_query_scores", "query_key_scores", "reference_attention",
           "weighted_values"]

# Masked logits take the most negative finite float32 rather than -inf: a fully masked row then
# stays finite (no inf - inf) and the explicit zeroing below turns it into zeros.
_MASKED_LOGIT = float(np.finfo(np.float32).min)


def _run(call: Call) -> jax.Array:
    """Fold segment ids and the static spec into the mask and run the reference maths."""
    mask, (q_len, kv_len) = call.mask, (call.query.shape[1], call.key.shape[1])
    query_segment_ids, key_segment_ids = call.segments
    if query_segment_ids is not None:
        mask = combine_masks(mask, segment_mask(query_segment_ids, key_segment_ids))
    if call.spec is not None:
        mask = combine_masks(mask, jnp.asarray(call.spec.dense(q_len, kv_len)[None, None]))
    key, value = (x.transpose(0, 2, 1, 3) for x in (call.key, call.value))
    return reference_attention(call.query, key, value, call.bias, mask,
                               (call.scale, call.softcap), query_key_scores, call.sinks)


def reference_attention(query, key, value, bias, mask, scores, score_product, sinks=None):
    """The materialised-scores maths over heads-major key and value [batch, num_kv_heads,
    kv_len, dim]; scores: (scale, softcap or None); score_product: `query_key_scores`, or
    `key_query_scores` for the few queries of a decoding step; sinks: float [num_heads] logits
    of a key with a zero value that every query sees, or None."""
    scale, softcap = scores
    batch, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    grouped_query = query.reshape(batch, q_len, num_kv_heads, num_heads // num_kv_heads,
                                  head_dim).transpose(0, 2, 3, 1, 4)
    logits = score_product(grouped_query, key)
    logits = logits * jnp.float32(scale)
    if softcap is not None:  # Gemma 2: before bias and mask
        logits = soft_cap(logits, softcap)
    mask = None if mask is None else grouped(mask, num_kv_heads)
    if bias is not None:
        bias = grouped(bias, num_kv_heads)
        logits = logits + bias.astype(jnp.float32)
        # A -inf bias hides its key as the mask does, so that a row it hides entirely returns
        # zeros with zero gradients (as in the blocked kernel) instead of exp(-inf + inf) = NaN.
        visible = ~jnp.isneginf(bias)
        mask = visible if mask is None else mask & visible
    if mask is not None:
        logits = jnp.where(mask, logits, _MASKED_LOGIT)
    # Softmax is shift invariant, so the row max needs no gradient.
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32).reshape(1, num_kv_heads, -1, 1, 1)
        row_max = jnp.maximum(row_max, sinks)
    row_max = jax.lax.stop_gradient(row_max)
    weights = jnp.exp(logits - row_max)
    if mask is not None:
        weights = jnp.where(mask, weights, 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:  # the sink's weight joins the sum; its value is zero
        total = total + jnp.exp(sinks - row_max)
    probs = weights / jnp.where(total == 0.0, 1.0, total)
    out = weighted_values(probs.astype(value.dtype), value).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, num_heads, value.shape[-1])


def grouped(x: jax.Array, num_kv_heads: int) -> jax.Array:
    """[b, h, t, s] (any dim may be 1) -> [b, k, g, t, s] matching grouped query heads."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, h, t, s = x.shape
    if h == 1:
        return x[:, :, None]
    return x.reshape(b, num_kv_heads, h // num_kv_heads, t, s)


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


KERNEL = Kernel("reference", _run)
