"""The static schedule of a blocked attention: which key blocks each query block visits.

Computed with numpy at trace time from the static part of the mask (`is_causal`, a sparse spec,
and the padding of the last key block), so the kernel loops over exactly the tiles that hold a
visible pair and skips the others outright. Tiles that are only partly visible carry a boolean
tile mask; identical tile masks are stored once (a causal diagonal with equal block sizes needs a
single one), so the plan stays small even for long sequences.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from tfx.ops.sparse import SparsitySpec

__all__ = ["BlockPlan", "block_plan"]


@dataclasses.dataclass(frozen=True, eq=False)
class BlockPlan:
    """Key blocks per query block, as padded tables (numpy, trace-time constants).

    Attributes:
      key_blocks: int32 [num_q_blocks, max_visits], the key blocks query block i visits: first
        the `full_visits[i]` fully visible ones, then the partly visible ones; entries past
        `visits[i]` are 0 and never read.
      visits: int32 [num_q_blocks], how many key blocks each query block visits (may be 0).
      full_visits: int32 [num_q_blocks], how many of those are fully visible (need no mask).
      tile_mask_ids: int32 [num_q_blocks, max_visits], index into `tile_masks` of each visit.
      tile_masks: bool [num_unique, block_q, block_k]; index 0 is the all-True tile.
    """

    key_blocks: np.ndarray
    visits: np.ndarray
    full_visits: np.ndarray
    tile_mask_ids: np.ndarray
    tile_masks: np.ndarray

    @property
    def num_tiles(self) -> int:
        """Tiles computed per (batch, head): the work of one forward pass, in tiles."""
        return int(self.visits.sum())


@functools.lru_cache(maxsize=128)
def block_plan(
    spec: SparsitySpec | None, q_len: int, kv_len: int, block_q: int, block_k: int
) -> BlockPlan:
    """Plan the tiles of a [q_len, kv_len] attention whose static mask is `spec`.

    Args:
      spec: the static mask (top-left aligned), or None for "every key is visible".
      q_len: unpadded query length.
      kv_len: unpadded key length; keys at kv_len and beyond (padding of the last block) are
        never visible.
      block_q: tile size along the queries.
      block_k: tile size along the keys.
    Returns:
      a BlockPlan with ceil(q_len / block_q) rows.
    """
    num_q_blocks = -(-q_len // block_q)
    num_k_blocks = -(-kv_len // block_k)
    if spec is None:
        layout = np.ones((num_q_blocks, num_k_blocks), dtype=bool)
    else:
        layout = spec.block_layout(q_len, kv_len, block_q, block_k)
    visits = layout.sum(axis=1).astype(np.int32)
    max_visits = max(int(visits.max()), 1)
    key_blocks = np.zeros((num_q_blocks, max_visits), dtype=np.int32)
    tile_mask_ids = np.zeros((num_q_blocks, max_visits), dtype=np.int32)
    full_visits = np.zeros(num_q_blocks, dtype=np.int32)
    unique = {np.ones((block_q, block_k), dtype=bool).tobytes(): 0}
    masks = [np.ones((block_q, block_k), dtype=bool)]
    offsets = np.arange(block_k)
    for qb in range(num_q_blocks):
        blocks = np.flatnonzero(layout[qb])
        # Query rows past q_len are padding whose output is dropped: they see what row 0 sees,
        # so they never turn a fully visible tile into a partial one.
        rows = qb * block_q + np.arange(block_q)
        rows = np.where(rows < q_len, rows, qb * block_q)[:, None, None]
        keys = (blocks[:, None] * block_k + offsets)[None]  # [1, visits, block_k]
        visible = keys < kv_len
        if spec is not None:
            visible = visible & spec.allows(rows, np.minimum(keys, kv_len - 1), kv_len)
        tiles = np.broadcast_to(visible, (block_q, blocks.size, block_k)).transpose(1, 0, 2)
        ids = np.empty(blocks.size, dtype=np.int32)
        for i, tile in enumerate(tiles):
            ids[i] = unique.setdefault(tile.tobytes(), len(unique))
            if ids[i] == len(masks):
                masks.append(tile.copy())
        order = np.argsort(ids > 0, kind="stable")  # fully visible tiles (id 0) first
        key_blocks[qb, : blocks.size] = blocks[order]
        tile_mask_ids[qb, : blocks.size] = ids[order]
        full_visits[qb] = np.count_nonzero(ids == 0)
    return BlockPlan(key_blocks, visits, full_visits, tile_mask_ids, np.stack(masks))
