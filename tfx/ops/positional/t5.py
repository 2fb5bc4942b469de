"""T5's bucketed relative position bias (Raffel et al., 2020; mesh-tensorflow)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from tfx.ops import _checks as checks

__all__ = ["relative_positions", "t5_relative_bias", "t5_relative_position_bucket"]


@jax.jit
def relative_positions(query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """Key position minus query position for every (query, key) pair.

    Args:
      query_positions: int `[q_len]` or `[batch, q_len]`.
      key_positions: int of the same rank, `[kv_len]` or `[batch, kv_len]`; batch dims must be
        equal or 1.
    Returns:
      int32 `[q_len, kv_len]` or `[batch, q_len, kv_len]`.
    """
    checks.integer("query_positions", query_positions)
    checks.integer("key_positions", key_positions)
    if query_positions.ndim not in (1, 2) or key_positions.ndim != query_positions.ndim:
        raise ValueError(
            "query_positions and key_positions must both be [len] or both [batch, len], got shapes "
            f"{tuple(query_positions.shape)} and {tuple(key_positions.shape)}"
        )
    query_batch, key_batch = query_positions.shape[:-1], key_positions.shape[:-1]
    if query_batch != key_batch and 1 not in query_batch + key_batch:
        raise ValueError(
            f"query_positions batch ({query_batch[0]}) and key_positions batch ({key_batch[0]}) "
            "must be equal or 1"
        )
    query = query_positions.astype(jnp.int32)[..., :, None]
    key = key_positions.astype(jnp.int32)[..., None, :]
    return key - query


def _check_buckets(name: str, num_buckets, bidirectional, max_distance) -> None:
    if not isinstance(bidirectional, bool):
        raise TypeError(f"bidirectional must be a bool, got {type(bidirectional).__name__}")
    checks.positive_int(name, num_buckets, minimum=2)
    # Each side needs at least one exact bucket, or T5's log formula divides by log(x / 0).
    if bidirectional and (num_buckets < 4 or num_buckets % 2):
        raise ValueError(f"{name} must be even and >= 4 when bidirectional, got {num_buckets}")
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    checks.positive_int("max_distance", max_distance, minimum=max_exact + 1)


@functools.partial(jax.jit, static_argnames=("bidirectional", "num_buckets", "max_distance"))
def t5_relative_position_bucket(
    relative_position: jax.Array,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> jax.Array:
    """Map key-minus-query offsets to T5's relative-attention buckets.

    Bidirectional (encoder): half the buckets per sign, positive offsets (keys after the query)
    in the upper half. Causal (decoder): only the distance to past keys counts; keys after the
    query share bucket 0. Per side, distances below max_exact = (buckets per side) / 2 get a
    bucket each; larger distances are binned logarithmically up to `max_distance`, beyond which
    they share the last bucket. The log runs in float32 and is truncated, as in T5.

    Args:
      relative_position: int array of any shape, key position minus query position.
      bidirectional: True for encoder self-attention, False for causal decoder self-attention.
      num_buckets: >= 2 (even and >= 4 when bidirectional).
      max_distance: > max_exact; distances from here on share the last bucket.
    Returns:
      int32 array of the same shape, values in [0, num_buckets).
    """
    checks.integer("relative_position", relative_position)
    _check_buckets("num_buckets", num_buckets, bidirectional, max_distance)
    relative_position = relative_position.astype(jnp.int32)
    if bidirectional:
        num_buckets //= 2
        first_bucket = jnp.where(relative_position > 0, num_buckets, 0)
        distance = jnp.abs(relative_position)
    else:
        first_bucket = 0
        distance = jnp.maximum(-relative_position, 0)
    max_exact = num_buckets // 2
    # Clamping below at max_exact only keeps log(0) out of the branch that `where` discards.
    log_ratio = jnp.log(jnp.maximum(distance, max_exact).astype(jnp.float32) / max_exact)
    log_bucket = max_exact + (
        log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    log_bucket = jnp.minimum(log_bucket, num_buckets - 1)
    return first_bucket + jnp.where(distance < max_exact, distance, log_bucket)


@functools.partial(jax.jit, static_argnames=("bidirectional", "max_distance"))
def t5_relative_bias(
    table: jax.Array,
    query_positions: jax.Array,
    key_positions: jax.Array,
    *,
    bidirectional: bool = True,
    max_distance: int = 128,
) -> jax.Array:
    """T5's additive attention bias: the learned per-head value of each pair's bucket.

    Args:
      table: float `[num_buckets, heads]`, the learned embedding (T5's relative_attention_bias);
        num_buckets is read from its shape.
      query_positions: int `[q_len]` or `[batch, q_len]` (e.g. `arange(q_len) + cache_length`).
      key_positions: int `[kv_len]` or `[batch, kv_len]`, same rank as query_positions.
      bidirectional: as in `t5_relative_position_bucket`.
      max_distance: as in `t5_relative_position_bucket`.
    Returns:
      `[heads, q_len, kv_len]`, or `[batch, heads, q_len, kv_len]` for batched positions, in the
      table's dtype; add it to the (unscaled) attention logits.
    """
    checks.floating("table", table, ndim=2, layout="[num_buckets, heads]")
    _check_buckets("table.shape[0] (num_buckets)", table.shape[0], bidirectional, max_distance)
    buckets = t5_relative_position_bucket(
        relative_positions(query_positions, key_positions),
        bidirectional=bidirectional,
        num_buckets=table.shape[0],
        max_distance=max_distance,
    )
    return jnp.moveaxis(table[buckets], -1, -3)
