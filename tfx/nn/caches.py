"""What one attention call attends besides its own keys: the cache kinds, behind one protocol.

`tfx.nn.Attention` asks the layer's cache three things, in this order:
1. `sources(x, context)`: the input its new keys and values are projected from (None: the
   call brings no new keys, all come from the cache);
2. `query_positions(positions, q_len)`: the true positions of the call's queries;
3. `attend(keys, x) -> (keys, state)`: given the call's own `Keys` (projected, rotated), the
   `Keys` every query attends and the layer's next cache state (None: nothing to return).

`NoCache` (plain self- or cross-attention) attends the call's keys. `KVLayer` is a decoder's
KV cache, linear or ring buffer (the `tfx.ops.kv_cache.CacheStep` of the call decides), with
heads-major keys; it serves a latent cache (`LatentKV`) the same way: multi-head latent
attention hands it its latent and rotary key as the `Keys`' key and value, and expands what it
gets back (`tfx.nn.latent_attention`). `SegmentLayer` is Transformer-XL's memory of earlier
inputs; `CrossKV` a cross-attention's keys and values computed once per encoder output.
`PagedLayer` is one layer's page pool of a paged cache (`tfx.ops.paged`): it writes the new keys
into their pages and hands the kernel `PagedKeys`, which attend through the page table
(`tfx.ops.attention.paged`) instead of a contiguous cache. `kv_cache_layer` picks the kind of a
KV-cache layer from the call's step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfx.ops.attention import dot_product_attention
from tfx.ops.attention.paged import PAGED_IMPLEMENTATIONS, paged_attention
from tfx.ops.kv_cache import CacheStep, LatentKV, LayerKV, write
from tfx.ops.masks import combine_masks
from tfx.ops.paged import PagedKV, PagedStep, write_pages
from tfx.ops.sparse import SparsitySpec

__all__ = ["CrossKV", "KVLayer", "Keys", "NoCache", "PagedKeys", "PagedLayer", "SegmentLayer",
           "cache_for", "kv_cache_layer"]


@dataclasses.dataclass(frozen=True)
class Keys:
    """Keys and values the queries attend, with everything that says which they may see.

    key, value: [batch, kv_len, num_kv_heads, head_dim], or heads-major [batch, num_kv_heads,
      kv_len, head_dim] when `heads_major` (as caches store them).
    positions: int [batch or 1, kv_len] true positions of the keys, or None (distances only).
    mask, bias, is_causal, sparsity, query_segment_ids, key_segment_ids: as in
      `tfx.ops.dot_product_attention`.
    """

    key: jax.Array
    value: jax.Array
    positions: jax.Array | None = None
    mask: jax.Array | None = None
    bias: jax.Array | None = None
    is_causal: bool = False
    sparsity: SparsitySpec | None = None
    query_segment_ids: jax.Array | None = None
    key_segment_ids: jax.Array | None = None
    heads_major: bool = False

    @property
    def kv_len(self) -> int:
        return self.key.shape[2 if self.heads_major else 1]

    def with_bias(self, bias: jax.Array | None) -> Keys:
        """These keys with `bias` added to their score bias (None adds nothing)."""
        if bias is None:
            return self
        return dataclasses.replace(self, bias=bias if self.bias is None else self.bias + bias)

    def attention(self, query: jax.Array, *, scale: float | None, softcap: float | None,
                  implementation: str | None,
                  block_sizes: tuple[int, int] | None) -> jax.Array:
        """[batch, q_len, num_heads, head_dim] -> [batch, q_len, num_heads, value_dim]:
        `tfx.ops.dot_product_attention` of the queries over these keys."""
        return dot_product_attention(
            query, self.key, self.value, bias=self.bias, mask=self.mask,
            is_causal=self.is_causal, scale=scale, softcap=softcap, sparsity=self.sparsity,
            query_segment_ids=self.query_segment_ids, key_segment_ids=self.key_segment_ids,
            implementation=implementation, block_sizes=block_sizes,
            heads_major=self.heads_major)


class NoCache:
    """Attention over the call's own keys: from `x` (self) or `context` (cross)."""

    def sources(self, x: jax.Array, context: jax.Array | None) -> jax.Array:
        return x if context is None else context

    def query_positions(self, positions: jax.Array | None, q_len: int) -> jax.Array:
        return jnp.arange(q_len) if positions is None else positions

    def attend(self, keys: Keys, x: jax.Array) -> tuple[Keys, None]:
        return keys, None


@dataclasses.dataclass(frozen=True)
class CrossKV(NoCache):
    """A cross-attention's keys and values of one encoder output, computed once
    (`Attention.keys_values`), heads-major; the call projects only its queries."""

    kv: LayerKV

    def sources(self, x, context):
        return None

    def attend(self, keys, x):
        return dataclasses.replace(keys, key=self.kv.key, value=self.kv.value,
                                   heads_major=True), None


@dataclasses.dataclass(frozen=True)
class KVLayer(NoCache):
    """One layer's KV cache (`LayerKV`, or `LatentKV` for latent attention) and the call's
    `CacheStep` (shared by the layers), which places the new tokens and says what each query
    sees."""

    kv: LayerKV | LatentKV
    step: CacheStep

    def query_positions(self, positions, q_len):
        return self.step.query_positions

    def attend(self, keys, x):
        key, value, kv = write(self.kv, keys.key, keys.value, self.step)
        return dataclasses.replace(
            keys, key=key, value=value, positions=self.step.key_positions,
            mask=combine_masks(keys.mask, self.step.mask), heads_major=True), kv


@dataclasses.dataclass(frozen=True)
class SegmentLayer(NoCache):
    """Transformer-XL's memory of one layer: the attention inputs of the last mem_len tokens
    [batch, mem_len, d_model], prepended to the segment's (the mask covers [memory | x]);
    the next memory is the last mem_len inputs, without gradient."""

    hidden: jax.Array

    def sources(self, x, context):
        if context is not None:
            raise ValueError("a Transformer-XL memory serves self-attention: context must be None")
        return jnp.concatenate([self.hidden.astype(x.dtype), x], axis=1)

    def attend(self, keys, x):
        source = jnp.concatenate([self.hidden.astype(x.dtype), x], axis=1)
        return dataclasses.replace(keys, positions=None), jax.lax.stop_gradient(
            source[:, x.shape[1]:])


@dataclasses.dataclass(frozen=True)
class PagedKeys(Keys):
    """A layer's page pools (key, value [num_kv_heads, num_pages, page_size, head_dim]) read
    through `page_table` [batch, pages_per_seq]; a query at `query_positions` [batch, q_len]
    p sees the logical positions 0..p (p < 0: padding). Visibility is all positional: no mask,
    bias or sparsity can be added (ALiBi, T5 bias, attention patterns and sliding windows are
    not served by a paged cache)."""

    page_table: jax.Array | None = None
    query_positions: jax.Array | None = None

    @property
    def kv_len(self) -> int:
        return self.page_table.shape[1] * self.key.shape[2]

    def attention(self, query, *, scale, softcap, implementation, block_sizes):
        """`tfx.ops.attention.paged`; `implementation` applies when it names a paged kernel
        ("reference", "blocked"), else the platform's choice runs; block_sizes is unused."""
        extras = [name for name in ("mask", "bias", "sparsity", "query_segment_ids")
                  if getattr(self, name) is not None]
        if extras or self.is_causal:
            raise ValueError(f"a paged cache takes visibility from positions only; this call "
                             f"also has {extras or ['is_causal']} (ALiBi, T5 bias, sliding "
                             "windows and attention patterns need a dense KV cache)")
        kernel = implementation if implementation in PAGED_IMPLEMENTATIONS else None
        return paged_attention(query, self.key, self.value, self.page_table,
                               self.query_positions, scale=scale, softcap=softcap,
                               implementation=kernel)


@dataclasses.dataclass(frozen=True)
class PagedLayer(NoCache):
    """One layer's page pools (`PagedKV`) of a paged cache and the call's `PagedStep`: writes
    the call's keys into their pages, then attends through the page table."""

    kv: PagedKV
    step: PagedStep

    def query_positions(self, positions, q_len):
        return self.step.query_positions

    def attend(self, keys, x):
        kv = write_pages(self.kv, keys.key, keys.value, self.step)
        return PagedKeys(kv.key, kv.value, mask=keys.mask, bias=keys.bias,
                         sparsity=keys.sparsity, page_table=self.step.page_table,
                         query_positions=self.step.query_positions), kv


def kv_cache_layer(kv: LayerKV | LatentKV | PagedKV, step: CacheStep | PagedStep) -> NoCache:
    """The cache kind of one layer for a call planned as `step`: `PagedLayer` for a paged
    cache's `PagedStep`, else `KVLayer`."""
    return (PagedLayer if isinstance(step, PagedStep) else KVLayer)(kv, step)


def cache_for(cache: NoCache | None, context: jax.Array | LayerKV | None) -> NoCache:
    """The cache kind serving a call: `cache` itself, or for none, the precomputed keys of a
    `LayerKV` context or plain attention."""
    if cache is not None:
        return cache
    return CrossKV(context) if isinstance(context, LayerKV) else NoCache()
