"""The reference attention kernel: materialises the [batch, heads, q_len, kv_len] scores.

It is the definition every faster kernel is tested against, and the maths of
`tfx.ops.attention.cached_attention` (the few queries of a decoding step over a heads-major
cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops.activations import softcap as soft_cap
from tfx.ops.attention.kernel import Call, Kernel
from tfx.ops.attention.score_products import query_key_scores, weighted_values
from tfx.ops.masks import combine_masks, segment_mask

__all__ = ["KERNEL", "reference_attention"]

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
    `key_query_scores` for the few queries of a decoding step
    (`tfx.ops.attention.score_products`); sinks: float [num_heads] logits of a key with a
    zero value that every query sees, or None."""
    scale, softcap = scores
    batch, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    grouped_query = query.reshape(batch, q_len, num_kv_heads, num_heads // num_kv_heads,
                                  head_dim).transpose(0, 2, 3, 1, 4)
    logits = score_product(grouped_query, key)
    logits = soft_cap(logits * jnp.float32(scale), softcap)  # Gemma 2: before bias and mask
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


KERNEL = Kernel("reference", _run)
