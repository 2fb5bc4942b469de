"""A paged KV cache (vLLM's PagedAttention, Kwon et al. 2023), as explicit pytrees.

A dense `tfx.ops.kv_cache.KVCache` gives every sequence max_len slots whether it uses them or
not. Here each layer holds one pool of fixed-size pages shared by all sequences, and a page
table maps each sequence's logical pages to pool pages, so a sequence costs the pages it holds
and pages are handed from finished sequences to new ones (`tfx.generation.Engine`).

Layout. Per layer `PagedKV`: key and value [num_kv_heads, num_pages, page_size, head_dim]
(with a leading [num_layers] axis when layers are scanned): the layout of jax's Pallas
paged-attention kernels, so that GPU/TPU decoding hands the pool to them without a copy, and
heads-major for the same reason as the dense cache (each head's keys are contracted in place).
Shared by the layers, `PagedCache.page_table` int32 [batch, pages_per_seq] (-1: no page) and
`next_position` [batch]. The token at true position p of row b lives in pool page
page_table[b, p // page_size] at offset p % page_size: slot page * page_size + offset of the
pool seen as [num_kv_heads, num_pages * page_size, head_dim]. Positions have no gaps (padding
takes none), so a query at p sees exactly the positions 0..p (`tfx.ops.attention.paged`).

Who owns the page table: the caller (an engine's allocator) assigns pages before a call brings
tokens to them; a token whose page is -1 or beyond the table is not stored.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tfx.ops import _checks
from tfx.ops._pytree import static_field
from tfx.ops._scatter import set_dropping
from tfx.ops.linear_attention.state import DeltaState

__all__ = ["PagedCache", "PagedKV", "PagedStep", "init_paged_cache", "write_pages"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """One layer's page pool: key and value [num_kv_heads, num_pages, page_size, head_dim]
    (with a leading [num_layers] axis when a model stacks its layers)."""

    key: jax.Array
    value: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedStep:
    """What one call writes and sees, computed once and shared by every layer.

    slots: int32 [batch, q_len], the pool slot (page * page_size + offset) each new token is
      written to; num_pages * page_size (out of range: dropped) for padding.
    query_positions: int32 [batch, q_len], true positions of the new tokens, -1 for padding.
    page_table: int32 [batch, pages_per_seq], as in the cache.
    page_size: tokens per page.
    """

    slots: jax.Array
    query_positions: jax.Array
    page_table: jax.Array
    page_size: int = static_field()

    @property
    def key_positions(self) -> jax.Array:
        """int32 [1, pages_per_seq * page_size]: the true position of each logical slot (the
        slot itself), as `CacheStep.key_positions` gives them to position encodings."""
        return jnp.arange(self.page_table.shape[1] * self.page_size, dtype=jnp.int32)[None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """A decoder's paged cache: per-layer page pools and the page table they share.

    layers: tuple of PagedKV, one per layer, or one with a leading [num_layers] axis; a hybrid
      model's linear-attention layers hold a `DeltaState` of one fixed-size state per row of
      the engine instead (no pages).
    page_table: int32 [batch, pages_per_seq], pool page of each logical page, -1 for none.
    next_position: int32 [batch], the true position of each sequence's next token.
    page_size: tokens per page.
    """

    layers: tuple[PagedKV | DeltaState, ...] | PagedKV
    page_table: jax.Array
    next_position: jax.Array
    page_size: int = static_field()

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold: pages_per_seq * page_size."""
        return self.page_table.shape[1] * self.page_size

    @property
    def num_pages(self) -> int:
        """Pages of each attention layer's pool (0 for a model without attention layers)."""
        layers = self.layers if isinstance(self.layers, tuple) else (self.layers,)
        pools = [layer for layer in layers if isinstance(layer, PagedKV)]
        return pools[0].key.shape[-3] if pools else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the page pools and of recurrent states (the page table is negligible)."""
        return sum(array.nbytes for array in jax.tree.leaves(self.layers))

    @property
    def state_bytes(self) -> int:
        """Bytes of the linear-attention layers' states (`DeltaState`), 0 without such
        layers."""
        layers = self.layers if isinstance(self.layers, tuple) else (self.layers,)
        return sum(layer.nbytes for layer in layers if isinstance(layer, DeltaState))

    def plan(self, valid: jax.Array) -> tuple[PagedStep, PagedCache]:
        """Place a call's new tokens after each sequence's last.

        Args:
          valid: bool [batch, q_len], False for padding (no position, no slot); a row may bring
            any number of tokens, none included.
        Returns:
          the PagedStep the layers use, and this cache with next_position advanced (its layers
          are replaced by the caller after the layers ran).
        """
        counts = jnp.cumsum(valid, axis=1, dtype=jnp.int32)
        positions = self.next_position[:, None] + counts - 1
        logical = positions // self.page_size
        width = self.page_table.shape[1]
        page = jnp.take_along_axis(self.page_table, jnp.clip(logical, 0, width - 1), axis=1)
        keep = valid & (logical < width) & (page >= 0)
        end = self.num_pages * self.page_size
        slots = jnp.where(keep, page * self.page_size + positions % self.page_size, end)
        step = PagedStep(slots=slots.astype(jnp.int32),
                         query_positions=jnp.where(valid, positions, -1),
                         page_table=self.page_table, page_size=self.page_size)
        next_position = self.next_position + jnp.sum(valid, axis=1, dtype=jnp.int32)
        return step, dataclasses.replace(self, next_position=next_position)


def write_pages(layer: PagedKV, key: jax.Array, value: jax.Array, step: PagedStep) -> PagedKV:
    """Store one layer's new keys and values in their pool slots.

    Args:
      layer: the layer's pools, [num_kv_heads, num_pages, page_size, head_dim] each.
      key: [batch, q_len, num_kv_heads, head_dim], already rotated at its position.
      value: [batch, q_len, num_kv_heads, head_dim].
      step: from `PagedCache.plan`.
    Returns:
      the updated PagedKV.
    """
    slots = step.slots.reshape(-1)

    def put(pool, new):
        heads, pages, page_size, dim = pool.shape
        flat = pool.reshape(heads, pages * page_size, dim)
        new = jnp.moveaxis(new.reshape(-1, *new.shape[2:]), 0, 1).astype(pool.dtype)
        return set_dropping(flat, (slice(None), slots), new, updates_axis=1).reshape(pool.shape)

    return PagedKV(put(layer.key, key), put(layer.value, value))


@functools.partial(jax.jit, static_argnames=(
    "num_layers", "num_pages", "page_size", "batch", "pages_per_seq", "num_kv_heads",
    "head_dim", "dtype", "stacked"))
def init_paged_cache(*, num_layers: int, num_pages: int, page_size: int, batch: int,
                     pages_per_seq: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
                     stacked: bool = False) -> PagedCache:
    """Empty page pools and a page table with no page assigned.

    Args:
      num_layers: int >= 1.
      num_pages: pages per layer's pool, int >= 1.
      page_size: tokens per page, int >= 1.
      batch: rows of the page table, int >= 1.
      num_kv_heads: int >= 1.
      head_dim: int >= 1.
      pages_per_seq: the page table's width: a sequence holds at most pages_per_seq * page_size
        tokens.
      dtype: of the pools.
      stacked: one PagedKV with a leading [num_layers] axis (scanned layers) instead of a tuple.
    Returns:
      PagedCache with pools [num_kv_heads, num_pages, page_size, head_dim] per layer (zeros),
      page_table -1 [batch, pages_per_seq] and next_position 0 [batch].
    """
    for name, number in (("num_layers", num_layers), ("num_pages", num_pages),
                         ("page_size", page_size), ("batch", batch),
                         ("pages_per_seq", pages_per_seq), ("num_kv_heads", num_kv_heads),
                         ("head_dim", head_dim)):
        _checks.positive_int(name, number)
    shape = (num_kv_heads, num_pages, page_size, head_dim)

    def layer(leading: tuple[int, ...]) -> PagedKV:
        return PagedKV(jnp.zeros((*leading, *shape), dtype), jnp.zeros((*leading, *shape), dtype))

    layers = layer((num_layers,)) if stacked else tuple(layer(()) for _ in range(num_layers))
    return PagedCache(layers=layers, page_table=jnp.full((batch, pages_per_seq), -1, jnp.int32),
                      next_position=jnp.zeros((batch,), jnp.int32), page_size=page_size)
