"""Boolean attention masks (True = may attend) that broadcast to [batch, heads, q_len, kv_len].

Every helper returns a 4-D mask so that masks combine with `combine_masks` and pass straight to
`tfx.ops.dot_product_attention(mask=...)`. Causal masks are built from positions rather than
indices, so cached decoding (queries at the end of the keys, a different position per sequence)
uses the same helper as training.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tfx.ops import _checks

__all__ = ["causal_mask", "combine_masks", "length_mask", "padding_mask", "segment_mask"]


def _batched(name: str, positions: jax.Array) -> jax.Array:
    """[len] -> [1, len]; [batch, len] unchanged."""
    _checks.integer(name, positions)
    if positions.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape [len] or [batch, len], got {positions.shape}")
    return positions[None] if positions.ndim == 1 else positions


@jax.jit
def causal_mask(query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """Key j is visible to query i when key_positions[j] <= query_positions[i].

    Args:
      query_positions: int [q_len] or [batch, q_len], the true position of each query (for cached
        decoding, the positions at the end of the cache).
      key_positions: int [kv_len] or [batch, kv_len].
    Returns:
      bool [batch or 1, 1, q_len, kv_len].
    """
    q = _batched("query_positions", query_positions)
    k = _batched("key_positions", key_positions)
    _checks.broadcastable("key_positions", k.shape[:1], q.shape[:1], "batch")
    return (k[:, None, None, :] <= q[:, None, :, None])


@jax.jit
def padding_mask(valid: jax.Array) -> jax.Array:
    """Mask out padded keys.

    Args:
      valid: bool [batch, kv_len], True for real tokens (Hugging Face's `attention_mask`, as bool).
    Returns:
      bool [batch, 1, 1, kv_len].
    """
    _checks.boolean("valid", valid)
    _checks.rank("valid", valid, 2, "[batch, kv_len]")
    return valid[:, None, None, :]


@functools.partial(jax.jit, static_argnames=("kv_len", "padding_side"))
def length_mask(lengths: jax.Array, kv_len: int, *, padding_side: str = "right") -> jax.Array:
    """Mask out padded keys given the number of real tokens per sequence.

    Args:
      lengths: int [batch], real tokens per sequence, in [0, kv_len].
      kv_len: the padded key length.
      padding_side: "right" (tokens first, padding after) or "left" (padding first).
    Returns:
      bool [batch, 1, 1, kv_len].
    """
    _checks.integer("lengths", lengths, ndim=1, layout="[batch]")
    _checks.positive_int("kv_len", kv_len)
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    index = jnp.arange(kv_len)
    if padding_side == "right":
        valid = index[None, :] < lengths[:, None]
    else:
        valid = index[None, :] >= kv_len - lengths[:, None]
    return valid[:, None, None, :]


@jax.jit
def segment_mask(
    query_segment_ids: jax.Array, key_segment_ids: jax.Array | None = None
) -> jax.Array:
    """Packed sequences: a query sees only keys of its own segment.

    Args:
      query_segment_ids: int [batch, q_len].
      key_segment_ids: int [batch, kv_len]; defaults to `query_segment_ids` (self-attention).
    Returns:
      bool [batch, 1, q_len, kv_len]. Combine with `causal_mask` for packed causal LM training.
    """
    if key_segment_ids is None:
        key_segment_ids = query_segment_ids
    _checks.integer("query_segment_ids", query_segment_ids, ndim=2, layout="[batch, q_len]")
    _checks.integer("key_segment_ids", key_segment_ids, ndim=2, layout="[batch, kv_len]")
    if key_segment_ids.shape[0] != query_segment_ids.shape[0]:
        raise ValueError(
            f"key_segment_ids batch ({key_segment_ids.shape[0]}) must equal "
            f"query_segment_ids batch ({query_segment_ids.shape[0]})"
        )
    return query_segment_ids[:, None, :, None] == key_segment_ids[:, None, None, :]


@jax.jit
def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
    """Logical AND of masks broadcastable to [batch, heads, q_len, kv_len]; `None`s are skipped.

    Returns:
      bool with the broadcast shape of the inputs, or None when every input is None.
    """
    for i, m in enumerate(masks):
        if m is not None:
            _checks.boolean(f"masks[{i}]", m, max_ndim=4)
    present = [m for m in masks if m is not None]
    if not present:
        return None
    try:
        jnp.broadcast_shapes(*(m.shape for m in present))
    except ValueError:
        shapes = ", ".join(str(tuple(m.shape)) for m in present)
        raise ValueError(f"masks of shapes {shapes} do not broadcast together") from None
    return functools.reduce(jnp.logical_and, present)
