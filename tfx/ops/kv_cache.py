"""Key/value caches for autoregressive decoding, as explicit pytrees.

Why keys and values and not queries: a new token's query is used once, by that token, but every
later token attends to its key and value. Caching them turns each decoding step from
O(seq * d_model^2) projections for the whole sequence so far into O(d_model^2) for one token.

Layout. Each layer holds `LayerKV` arrays [batch, num_kv_heads, cache_len, head_dim] (GQA/MQA
store only their KV heads), or for multi-head latent attention (DeepSeek-V2/V3, `LatentKV`)
only the compressed latent and the one rotary key shared by the heads, from which the layer
recomputes its keys and values. Heads-major rather than the [batch, seq, heads, dim] of
activations: attention then contracts each head's keys in place instead of transposing the
whole cache at every step (see `tfx.ops.attention.cached_attention`). Shared by the layers,
`KVCache.positions` [batch, cache_len] records the true position of the token in each slot
(-1: empty), and `next_position` [batch] where each sequence goes on. A token at true position
p lives in slot p, or p % window for a sliding-window ring buffer, so prompts of different
lengths (left- or right-padded) decode side by side and padding never occupies a slot.
Visibility is computed from positions (valid, causal, within the window), which makes the ring
buffer exact however far decoding runs past the window.

One call of a model with a cache is planned once (`KVCache.plan`, shared by every layer) and then
each layer writes and reads its own keys and values (`write`). A hybrid model's linear-attention
layers hold a fixed-size `tfx.ops.linear_attention.DeltaState` in their place of `layers`: it
follows its rows in `take`, counts in `state_bytes` rather than `bytes_per_token`, and rewinds
from the states it kept before its last tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tfx.ops import _checks
from tfx.ops._pytree import static_field
from tfx.ops._scatter import set_dropping
from tfx.ops.linear_attention.state import DeltaState, rewind_state

__all__ = [
    "CacheStep",
    "KVCache",
    "LatentKV",
    "LayerKV",
    "SegmentMemory",
    "Seq2SeqCache",
    "init_cache",
    "init_latent_cache",
    "init_memory",
    "write",
]


class _LayerArrays:
    """What a layer's cache is to `write` and `KVCache`: its dataclass fields, in order, each an
    array [batch, heads, cache_len, dim] (with a leading [num_layers] axis when stacked)."""

    @property
    def arrays(self) -> tuple[jax.Array, ...]:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKV(_LayerArrays):
    """One attention layer's keys and values, each [batch, num_kv_heads, cache_len, head_dim]
    (with a leading [num_layers] axis when a model stacks its layers)."""

    key: jax.Array
    value: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentKV(_LayerArrays):
    """One multi-head latent attention layer's cache (`tfx.nn.LatentAttention`): what its keys
    and values are computed from, with one "head" each so that `write` stores them as it
    stores keys (with a leading [num_layers] axis when a model stacks its layers).

    latent: [batch, 1, cache_len, kv_lora_rank], the normalised compressed latent c.
    rope_key: [batch, 1, cache_len, qk_rope_head_dim], the rotary key shared by all heads,
      already rotated at its position.
    """

    latent: jax.Array
    rope_key: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheStep:
    """What one call writes and sees, computed once and shared by every layer.

    slots: int32 [batch, q_len], the slot each new token is written to (cache_len: not written,
      for padding, or for chunk tokens a ring buffer has no room for).
    query_positions: int32 [batch, q_len], true positions of the new tokens.
    key_positions: int32 [batch, kv_len], true positions of the keys attended (-1: nothing).
    mask: bool [batch, 1, q_len, kv_len].
    append: attend to the cache as it was plus the new keys (kv_len = cache_len + q_len), then
      write; used when a ring buffer receives several tokens at once, because their writes may
      overwrite keys that earlier tokens of the same chunk still see. Otherwise write first and
      attend to the cache (kv_len = cache_len).
    """

    slots: jax.Array
    query_positions: jax.Array
    key_positions: jax.Array
    mask: jax.Array
    append: bool = static_field()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """A decoder's cache: per-layer keys/values and the slot bookkeeping the layers share.

    layers: tuple of LayerKV (or LatentKV), one per layer, or one with a leading [num_layers]
      axis; a hybrid model's linear-attention layers hold a fixed-size `DeltaState` instead.
    positions: int32 [batch, cache_len], true position held by each slot, -1 when empty.
    next_position: int32 [batch], the true position of each sequence's next token.
    window: sliding-window size when the cache is a ring buffer of `window` slots, else None.
    """

    layers: tuple[LayerKV | LatentKV | DeltaState, ...] | LayerKV | LatentKV
    positions: jax.Array
    next_position: jax.Array
    window: int | None = static_field()

    @classmethod
    def no_layers(cls, batch: int, cache_len: int, window: int | None = None) -> KVCache:
        """A cache with empty slots and no layers yet: the position bookkeeping alone, to
        which a model adds its layers' entries (`dataclasses.replace(cache, layers=...)`)."""
        return cls(layers=(), positions=jnp.full((batch, cache_len), -1, jnp.int32),
                   next_position=jnp.zeros((batch,), jnp.int32), window=window)

    @property
    def nbytes(self) -> int:
        """Bytes of cached keys and values and of recurrent states (the bookkeeping is
        negligible)."""
        layers = self.layers if isinstance(self.layers, tuple) else (self.layers,)
        # None: a layer that attends another's keys (attention.shared_kv_layers) keeps none.
        return sum(layer.nbytes for layer in layers if layer is not None)

    @property
    def state_bytes(self) -> int:
        """Bytes of the linear-attention layers' states (`DeltaState`, their histories
        included): fixed whatever the sequence length, 0 for a model of attention layers."""
        layers = self.layers if isinstance(self.layers, tuple) else (self.layers,)
        return sum(layer.nbytes for layer in layers if isinstance(layer, DeltaState))

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token costs, all attention layers together: per layer 2 ·
        num_kv_heads · head_dim · itemsize for keys and values (MHA/GQA/MQA), (kv_lora_rank +
        qk_rope_head_dim) · itemsize for a latent cache (`init_latent_cache`); linear-attention
        layers cost none (`state_bytes`)."""
        return (self.nbytes - self.state_bytes) // self.positions.size

    def take(self, rows: jax.Array) -> KVCache:
        """The cache of sequences `rows` (int [new_batch]), e.g. to expand a batch into beams
        or to follow the beams that survived a step (recurrent states follow their rows)."""
        stacked = not isinstance(self.layers, tuple)
        layers = jax.tree.map(lambda x: jnp.take(x, rows, axis=1 if stacked else 0), self.layers)
        return KVCache(layers=layers, positions=self.positions[rows],
                       next_position=self.next_position[rows], window=self.window)

    def rewind(self, next_position: jax.Array) -> KVCache:
        """This cache with every token at true position >= `next_position` forgotten, e.g. the
        draft tokens that speculative decoding rejected: those slots become empty (position -1,
        so no query sees them) and each row continues at its new next position. The keys and
        values stay in place until the next tokens overwrite them; positions alone decide what
        is visible. A linear-attention layer's `DeltaState` takes the state it had at the new
        length from its history (`tfx.ops.linear_attention.rewind_state`).

        Args:
          next_position: int [batch]; a row already shorter keeps its length (rewinding never
            invents tokens).
        Returns:
          the rewound KVCache (layers, positions and next_position updated).
        Raises:
          ValueError: for a ring buffer (sliding window shorter than the cache), whose slots
            already hold later tokens in place of the earlier ones that a rewind would need,
            or for recurrent states kept without a history (`init_cache(..., rewind=n)`).
        """
        if self.window is not None:
            raise ValueError(f"a ring-buffer KV cache (sliding window {self.window} shorter than "
                             f"the sequence) cannot be rewound: its slots were overwritten")
        next_position = jnp.minimum(jnp.asarray(next_position, jnp.int32), self.next_position)
        positions = jnp.where(self.positions >= next_position[:, None], -1, self.positions)
        layers = self.layers
        if isinstance(layers, tuple):
            layers = tuple(rewind_state(layer, next_position) if isinstance(layer, DeltaState)
                           else layer for layer in layers)
        return dataclasses.replace(self, layers=layers, positions=positions,
                                   next_position=next_position)

    def plan(self, valid: jax.Array) -> tuple[CacheStep, KVCache]:
        """Place a call's new tokens.

        Args:
          valid: bool [batch, q_len], False for padding (which gets no position and no slot).
        Returns:
          the CacheStep the layers use, and this cache with updated positions and
          next_position (its layers are replaced by the caller after the layers ran).
        """
        batch, q_len = valid.shape
        cache_len = self.positions.shape[1]
        counts = jnp.cumsum(valid, axis=1, dtype=jnp.int32)
        query_positions = self.next_position[:, None] + counts - 1
        next_position = self.next_position + jnp.sum(valid, axis=1, dtype=jnp.int32)
        keep = valid
        if self.window is not None:  # only the last `cache_len` tokens of the chunk fit
            keep = keep & (query_positions >= next_position[:, None] - cache_len)
            slots = query_positions % cache_len
        else:
            slots = query_positions
        slots = jnp.where(keep, slots, cache_len)
        rows = jnp.arange(batch)[:, None]
        positions = self.positions.at[rows, slots].set(query_positions, mode="drop")
        append = self.window is not None and q_len > 1
        if append:
            key_positions = jnp.concatenate(
                [self.positions, jnp.where(valid, query_positions, -1)], axis=1)
        else:
            key_positions = positions
        q, k = query_positions[:, None, :, None], key_positions[:, None, None, :]
        mask = (k >= 0) & (k <= q)
        if self.window is not None:
            mask = mask & (q - k < self.window)
        step = CacheStep(slots=slots, query_positions=query_positions,
                         key_positions=key_positions, mask=mask, append=append)
        return step, dataclasses.replace(self, positions=positions, next_position=next_position)


def write(layer: LayerKV | LatentKV, key: jax.Array, value: jax.Array,
          step: CacheStep) -> tuple[jax.Array, jax.Array, LayerKV | LatentKV]:
    """Store one layer's new keys and values and return what the layer attends to.

    Args:
      layer: the layer's cache, [batch, num_kv_heads, cache_len, head_dim] each; or a
        `LatentKV`, whose latent and rotary key take the places of key and value.
      key: [batch, q_len, num_kv_heads, head_dim], already rotated (RoPE) at its positions.
      value: [batch, q_len, num_kv_heads, head_dim].
      step: from `KVCache.plan`.
    Returns:
      keys and values to attend, heads-major [batch, num_kv_heads, kv_len, head_dim] (kv_len as
      in `step`), and the updated layer cache (of the type of `layer`).
    """
    rows = jnp.arange(key.shape[0])[:, None]

    def put(cached, new):  # new [batch, q_len, heads, dim] lands at [rows, :, slots]
        return set_dropping(cached, (rows, slice(None), step.slots), new.astype(cached.dtype))

    news = (key, value)
    updated = type(layer)(*map(put, layer.arrays, news))
    if step.append:
        def chunk(cached, new):
            return jnp.concatenate([cached, jnp.swapaxes(new, 1, 2).astype(cached.dtype)], axis=2)

        return (*map(chunk, layer.arrays, news), updated)
    return (*updated.arrays, updated)


@functools.partial(jax.jit, static_argnames=(
    "num_layers", "batch", "max_len", "num_kv_heads", "head_dim", "dtype", "window", "stacked"))
def init_cache(*, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32, window: int | None = None, stacked: bool = False) -> KVCache:
    """An empty cache for sequences of up to `max_len` tokens (input and generated together).

    With a sliding `window` shorter than max_len the cache is a ring buffer of `window` slots,
    so its memory does not grow with the sequence.

    Args:
      num_layers: positive int.
      batch: positive int.
      num_kv_heads: positive int.
      head_dim: positive int.
      max_len: the largest true position + 1 that will be decoded. A linear cache cannot
        grow inside jit: tokens at positions >= max_len are not stored (and so not attended),
        which is why `tfx.generate` sizes the cache itself and checks lengths first.
      dtype: of the cached keys and values.
      window: the model's sliding window (keys q - window < k <= q), or None.
      stacked: one LayerKV with a leading [num_layers] axis (scanned layers) instead of a tuple.
    Returns:
      KVCache with layers [batch, num_kv_heads, cache_len, head_dim], cache_len = max_len or
      window.
    """
    for name, number in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        _checks.positive_int(name, number)
    return _empty_cache(LayerKV, ((num_kv_heads, head_dim),) * 2, num_layers=num_layers,
                        batch=batch, max_len=max_len, dtype=dtype, window=window,
                        stacked=stacked)


@functools.partial(jax.jit, static_argnames=(
    "num_layers", "batch", "max_len", "kv_lora_rank", "qk_rope_head_dim", "dtype", "window",
    "stacked"))
def init_latent_cache(*, num_layers: int, batch: int, max_len: int, kv_lora_rank: int,
                      qk_rope_head_dim: int, dtype=jnp.float32, window: int | None = None,
                      stacked: bool = False) -> KVCache:
    """An empty cache for multi-head latent attention (`tfx.nn.LatentAttention`): per layer only
    the compressed latent and the shared rotary key, (kv_lora_rank + qk_rope_head_dim) values
    per token instead of 2 · num_kv_heads · head_dim. Slots, positions, padding and the ring
    buffer are those of `init_cache` (same arguments), so `KVCache.plan` and `tfx.generate`
    serve it unchanged.

    Returns:
      KVCache whose layers are `LatentKV`: latent [batch, 1, cache_len, kv_lora_rank] and
      rope_key [batch, 1, cache_len, qk_rope_head_dim] (a tuple of one per layer, or one with
      a leading [num_layers] axis when `stacked`).
    """
    for name, number in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim)):
        _checks.positive_int(name, number)
    return _empty_cache(LatentKV, ((1, kv_lora_rank), (1, qk_rope_head_dim)),
                        num_layers=num_layers, batch=batch, max_len=max_len, dtype=dtype,
                        window=window, stacked=stacked)


def _empty_cache(layer_type: type, dims: tuple[tuple[int, int], ...], *, num_layers: int,
                 batch: int, max_len: int, dtype, window: int | None,
                 stacked: bool) -> KVCache:
    """A cache of `layer_type` layers, one array [batch, heads, cache_len, dim] for each
    (heads, dim) of `dims`, with no slot filled (see `init_cache` for the arguments)."""
    for name, number in (("num_layers", num_layers), ("batch", batch), ("max_len", max_len)):
        _checks.positive_int(name, number)
    if window is not None:
        _checks.positive_int("window", window)
    ring = window is not None and window < max_len
    cache_len = window if ring else max_len

    def layer(leading: tuple[int, ...]):
        return layer_type(*(jnp.zeros((*leading, batch, heads, cache_len, dim), dtype)
                            for heads, dim in dims))

    layers = layer((num_layers,)) if stacked else tuple(layer(()) for _ in range(num_layers))
    return dataclasses.replace(KVCache.no_layers(batch, cache_len, window if ring else None),
                               layers=layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Seq2SeqCache:
    """An encoder–decoder's decoding state: the decoder's self-attention KVCache, every layer's
    cross-attention keys/values of the encoder output (computed once), and the encoder mask.

    cross: tuple of LayerKV [batch, num_kv_heads, src_len, head_dim], or one stacked LayerKV.
    context_mask: bool [batch, 1, 1, src_len], or None when the source has no padding.
    """

    decoder: KVCache
    cross: tuple[LayerKV, ...] | LayerKV
    context_mask: jax.Array | None

    @property
    def nbytes(self) -> int:
        cross = self.cross if isinstance(self.cross, tuple) else (self.cross,)
        return self.decoder.nbytes + sum(layer.nbytes for layer in cross)

    def take(self, rows: jax.Array) -> Seq2SeqCache:
        """The state of sequences `rows` (int [new_batch]); see `KVCache.take`."""
        stacked = not isinstance(self.cross, tuple)
        cross = jax.tree.map(lambda x: jnp.take(x, rows, axis=1 if stacked else 0), self.cross)
        mask = None if self.context_mask is None else self.context_mask[rows]
        return Seq2SeqCache(decoder=self.decoder.take(rows), cross=cross, context_mask=mask)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentMemory:
    """Transformer-XL's recurrence (Dai et al. 2019): every layer's attention inputs for the last
    mem_len tokens, prepended to the next segment's keys and values without gradient.

    Relative attention needs only distances, and the memory holds consecutive tokens, so no
    positions are stored; padding must therefore come first (left-padded prompts).

    hidden: tuple of [batch, mem_len, d_model], one per layer, or one stacked array.
    valid: bool [batch, mem_len], False for empty slots and padding.
    """

    hidden: tuple[jax.Array, ...] | jax.Array
    valid: jax.Array

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in jax.tree.leaves(self.hidden))

    def take(self, rows: jax.Array) -> SegmentMemory:
        """The memory of sequences `rows` (int [new_batch]); see `KVCache.take`."""
        stacked = not isinstance(self.hidden, tuple)
        hidden = jax.tree.map(lambda x: jnp.take(x, rows, axis=1 if stacked else 0),
                              self.hidden)
        return SegmentMemory(hidden=hidden, valid=self.valid[rows])

    def mask(self, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Visibility for a segment of q_len new tokens, and the memory's next validity.

        Args:
          valid: bool [batch, q_len], False for padding.
        Returns:
          bool [batch, 1, q_len, mem_len + q_len] (key j visible to query i when it is valid and
          j <= mem_len + i), and bool [batch, mem_len].
        """
        mem_len, q_len = self.valid.shape[1], valid.shape[1]
        keys_valid = jnp.concatenate([self.valid, valid], axis=1)
        causal = jnp.arange(mem_len + q_len)[None, :] <= mem_len + jnp.arange(q_len)[:, None]
        return causal[None, None] & keys_valid[:, None, None, :], keys_valid[:, q_len:]


def init_memory(*, num_layers: int, batch: int, mem_len: int, d_model: int,
                dtype=jnp.float32, stacked: bool = False) -> SegmentMemory:
    """An empty Transformer-XL memory of `mem_len` tokens per layer ([batch, mem_len, d_model]
    each, with a leading [num_layers] axis when `stacked`)."""
    for name, number in (("num_layers", num_layers), ("batch", batch), ("mem_len", mem_len),
                         ("d_model", d_model)):
        _checks.positive_int(name, number)
    shape = (batch, mem_len, d_model)
    hidden = (jnp.zeros((num_layers, *shape), dtype) if stacked
              else tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))
    return SegmentMemory(hidden=hidden, valid=jnp.zeros((batch, mem_len), bool))
