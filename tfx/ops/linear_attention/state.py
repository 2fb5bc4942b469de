"""A linear-attention layer's memory in a decoder's cache (`DeltaState`): the short
convolution's last inputs and the delta rule's state, a fixed size however long the sequence.

A KV cache forgets its latest tokens by position (`tfx.ops.kv_cache.KVCache.rewind`, for the
draft tokens that speculative decoding rejects); a recurrent state cannot, since every token
was folded into it. A state built with a `DeltaHistory` therefore also keeps the states it had
before each of its last `size` tokens, in a ring indexed by token count, and `rewind_state`
takes the one at the wanted length. A layer records them as it runs (`record`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["DeltaHistory", "DeltaState", "empty_state", "record", "rewind_state"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaHistory:
    """The states before each of a layer's last `size` tokens, a ring over token counts.

    conv: [batch, size, kernel_size - 1, channels]; delta: float32 [batch, size, heads,
      key_dim, value_dim]: in slot n % size, the states after the first n tokens.
    lengths: int32 [batch, size], the n of each slot (-1: none).
    length: int32 [batch], the tokens the layer has seen (real ones: padding does not count).
    """

    conv: jax.Array
    delta: jax.Array
    lengths: jax.Array
    length: jax.Array

    @property
    def size(self) -> int:
        return self.lengths.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaState:
    """What a Gated DeltaNet layer remembers of the tokens before a call.

    conv: [batch, kernel_size - 1, channels], the last real inputs of the short convolution
      (channels = 2 · key_heads · key_dim + heads · value_dim); delta: [batch, heads, key_dim,
      value_dim] float32, the delta rule's state.
    history: the states before the last tokens, for `rewind_state`; None when the cache is
      never rewound.
    """

    conv: jax.Array
    delta: jax.Array
    history: DeltaHistory | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the states (the same for any sequence length), the history included."""
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self))


def empty_state(batch: int, *, kernel_size: int, channels: int, heads: int, key_dim: int,
                value_dim: int, dtype=jnp.float32, history: int = 0) -> DeltaState:
    """The memory before the first token: zeros; with `history` > 0, room for the states
    before each of the last `history` tokens (and the empty state recorded at length 0)."""
    conv = jnp.zeros((batch, kernel_size - 1, channels), dtype)
    delta = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    if not history:
        return DeltaState(conv, delta)
    lengths = jnp.full((batch, history), -1, jnp.int32).at[:, 0].set(0)
    ring = DeltaHistory(jnp.zeros((batch, history, *conv.shape[1:]), dtype),
                        jnp.zeros((batch, history, *delta.shape[1:]), jnp.float32),
                        lengths, jnp.zeros((batch,), jnp.int32))
    return DeltaState(conv, delta, ring)


def record(history: DeltaHistory, conv: jax.Array, delta: jax.Array, token_mask: jax.Array,
           earlier: jax.Array) -> DeltaHistory:
    """`history` after a call: the states before each of the call's last tokens put in the
    ring (real tokens only) and the length advanced.

    Args:
      history: the layer's ring before the call.
      conv: [batch, last, kernel_size - 1, channels], the convolution state before each of the
        call's last `last` tokens (`last` <= history.size, so that no two collide).
      delta: float32 [batch, last, heads, key_dim, value_dim], the delta state before each.
      token_mask: bool [batch, last], False for padding (not recorded).
      earlier: int32 [batch], real tokens of the call before those `last`.
    Returns:
      the DeltaHistory after the call.
    """
    last = token_mask.shape[1]
    if last > history.size:
        raise ValueError(f"{last} states do not fit a history of {history.size}")
    real = token_mask.astype(jnp.int32)
    lengths = history.length[:, None] + earlier[:, None] + jnp.cumsum(real, axis=1) - real
    slots = jnp.where(token_mask, lengths % history.size, history.size)  # padding: dropped
    rows = jnp.arange(lengths.shape[0])[:, None]

    def put(ring, new):
        return ring.at[rows, slots].set(new.astype(ring.dtype), mode="drop")

    return DeltaHistory(put(history.conv, conv), put(history.delta, delta),
                        put(history.lengths, lengths),
                        history.length + earlier + jnp.sum(real, axis=1))


def rewind_state(state: DeltaState, length: jax.Array) -> DeltaState:
    """The state after the first `length` tokens: the latest tokens forgotten.

    Args:
      state: a DeltaState with a history.
      length: int [batch]; a row already shorter keeps its state (rewinding never invents
        tokens). A row whose state at `length` is no longer in the ring (rewound further than
        history.size tokens) gets NaN states, so that the mistake shows.
    Returns:
      the rewound DeltaState (history entries past the new length dropped).
    Raises:
      ValueError: for a state without a history.
    """
    history = state.history
    if history is None:
        raise ValueError("a recurrent state (linear-attention layer) cannot forget tokens "
                         "without the states it had before them: build the cache with "
                         "init_cache(..., rewind=n) to rewind up to n tokens")
    length = jnp.minimum(jnp.asarray(length, jnp.int32), history.length)
    slot = length % history.size
    rows = jnp.arange(length.shape[0])
    found = history.lengths[rows, slot] == length
    moved = length < history.length

    def pick(now, ring):
        old = jnp.where(found.reshape(-1, *[1] * (now.ndim - 1)), ring[rows, slot],
                        jnp.full((), jnp.nan, ring.dtype))
        return jnp.where(moved.reshape(-1, *[1] * (now.ndim - 1)), old.astype(now.dtype), now)

    # entries past the new length belong to forgotten tokens: a later rewind must not find them
    lengths = jnp.where(history.lengths > length[:, None], -1, history.lengths)
    return DeltaState(pick(state.conv, history.conv), pick(state.delta, history.delta),
                      dataclasses.replace(history, lengths=lengths, length=length))
