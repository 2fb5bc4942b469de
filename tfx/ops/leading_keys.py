"""Learned keys and values put before a call's real ones (e.g. by a fine-tuning method, as in
Li & Liang 2021), with the masks and biases that describe the keys widened to match."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfx.ops.masks import combine_masks, segment_mask
from tfx.ops.sparse import LeadingKeys, SparsitySpec

__all__ = ["prepend_keys"]


def prepend_keys(leading: tuple[jax.Array, jax.Array], key: jax.Array, value: jax.Array, *,
                 heads_major: bool = False, mask: jax.Array | None = None,
                 bias: jax.Array | None = None, spec: SparsitySpec | None = None,
                 query_segment_ids: jax.Array | None = None,
                 key_segment_ids: jax.Array | None = None):
    """Put leading keys/values before the real ones and widen what describes the keys.

    Args:
      leading: keys and values, each [num_leading, num_kv_heads, head_dim] (shared by the
        batch; already "rotated": RoPE is not applied to them, as with Hugging Face
        past_key_values).
      key: [batch, kv_len, num_kv_heads, head_dim], or heads-major
        [batch, num_kv_heads, kv_len, head_dim] (caches) when `heads_major`.
      value: laid out as key.
      mask: broadcastable to [batch, heads, q_len, kv_len]. Every query sees all leading
        columns (mask True).
      bias: broadcastable to [batch, heads, q_len, kv_len]; 0 over the leading columns:
        ALiBi, T5 and Transformer-XL position terms describe distances between real tokens,
        which leading vectors have none of.
      spec: the static mask (causal, sparsity) over the real keys, or None.
      query_segment_ids: packed sequences; folded with key_segment_ids into the mask (the
        leading keys belong to every segment), which costs a [batch, 1, q_len, kv_len] bool
        mask.
      key_segment_ids: the keys' segments, as query_segment_ids.
    Returns:
      (key, value, mask, bias, sparsity): keys and values with num_leading + kv_len keys in
      the same layout, and the mask, bias and static spec (`LeadingKeys`) for them.
      Concatenating copies the keys (with a cache, one more pass over it per step); in
      exchange caches hold real tokens only.
    """
    num_leading = leading[0].shape[0]
    axis = 2 if heads_major else 1
    kv_len = key.shape[axis]

    def prepend(real, learned):
        learned = jnp.swapaxes(learned, 0, 1) if heads_major else learned
        learned = jnp.broadcast_to(learned.astype(real.dtype), (real.shape[0], *learned.shape))
        return jnp.concatenate([learned, real], axis=axis)

    def widen(x, fill):
        if x is None:
            return None
        x = x.reshape((1,) * (4 - x.ndim) + x.shape)
        x = jnp.broadcast_to(x, (*x.shape[:3], kv_len))
        return jnp.pad(x, [(0, 0)] * 3 + [(num_leading, 0)], constant_values=fill)

    if query_segment_ids is not None:
        mask = combine_masks(mask, segment_mask(query_segment_ids, key_segment_ids))
    sparsity = None if spec is None else LeadingKeys(spec, num_leading)
    return (prepend(key, leading[0]), prepend(value, leading[1]), widen(mask, True),
            widen(bias, 0), sparsity)
