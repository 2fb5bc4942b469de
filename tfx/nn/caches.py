"""The caches an attention call attends besides its own keys, behind the protocol of
`tfx.nn.attention` (`sources`, `query_positions`, `attend`; `NoCache` and `CrossKV`, plain
self- and cross-attention, are there, beside `Attention`).

`KVLayer` is a decoder's KV cache, linear or ring buffer (the `tfx.ops.kv_cache.CacheStep` of
the call decides), with heads-major keys; it serves a latent cache (`LatentKV`) the same way:
multi-head latent attention hands it its latent and rotary key as the `Keys`' key and value,
and expands what it gets back (`tfx.nn.latent_attention`). `SegmentLayer` is Transformer-XL's
memory of earlier inputs. `PagedLayer` is one layer's page pool of a paged cache
(`tfx.ops.paged`): it writes the new keys into their pages and hands the kernel `PagedKeys`,
which attend through the page table (`tfx.ops.attention.paged`) instead of a contiguous cache.
`kv_cache_layer` picks the kind of a KV-cache layer from the call's step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfx.nn.attention import Keys, NoCache
from tfx.ops.attention.paged import PAGED_IMPLEMENTATIONS, paged_attention
from tfx.ops.kv_cache import CacheStep, LatentKV, LayerKV, write
from tfx.ops.linear_attention import DeltaState
from tfx.ops.masks import combine_masks
from tfx.ops.paged import PagedKV, PagedStep, write_pages

__all__ = ["KVLayer", "PagedKeys", "PagedLayer", "SegmentLayer", "kv_cache_layer"]


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

    def attention(self, query, *, scale, softcap, implementation, block_sizes, sinks=None):
        """`tfx.ops.attention.paged` (with the attention's sink logits, or None);
        `implementation` applies when it names a paged kernel ("reference", "blocked"), else
        the platform's choice runs; block_sizes is unused."""
        extras = [name for name in ("mask", "bias", "sparsity", "query_segment_ids")
                  if getattr(self, name) is not None]
        if extras or self.is_causal:
            raise ValueError(f"a paged cache takes visibility from positions only; this call "
                             f"also has {extras or ['is_causal']} (ALiBi, T5 bias, sliding "
                             "windows and attention patterns need a dense KV cache)")
        kernel = implementation if implementation in PAGED_IMPLEMENTATIONS else None
        return paged_attention(query, self.key, self.value, self.page_table,
                               self.query_positions, scale=scale, softcap=softcap,
                               implementation=kernel, sinks=sinks)


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


def kv_cache_layer(kv: LayerKV | LatentKV | PagedKV | DeltaState,
                   step: CacheStep | PagedStep) -> NoCache | DeltaState:
    """The cache kind of one layer for a call planned as `step`: `PagedLayer` for a paged
    cache's `PagedStep`, else `KVLayer`; a linear layer's `DeltaState` as it is (its memory
    is the same whatever the step)."""
    if isinstance(kv, DeltaState):
        return kv
    return (PagedLayer if isinstance(step, PagedStep) else KVLayer)(kv, step)
