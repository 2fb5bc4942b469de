"""The blocked kernel's tile sizes, chosen per call from the static mask.

Every visited tile costs its pairs (all of them, visible or not) plus a fixed overhead: one
more step of the key loop, one more running-softmax update, and the lower efficiency of small
matmuls. Large tiles pay the overhead least often; small tiles skip more invisible pairs. So the
kernel picks, among `CANDIDATES`, the tiles of least modelled cost

    visited tiles x (block_q x block_k + TILE_OVERHEAD_PAIRS)

read off the exact block layout of the static mask (`SparsitySpec.block_layout`). Without a
static mask every tile is visited and the largest tiles win. With one, small tiles win where
its visible pairs cluster in blocks smaller than the default tiles: BigBird's 64-key random
blocks and global tokens leave a 256 x 512 tile nearly empty, a 64 x 64 one nearly full.
"""

from __future__ import annotations

import functools

from tfx.ops.blocked_attention import BLOCK_K, BLOCK_Q
from tfx.ops.sparse import SparsitySpec

__all__ = ["CANDIDATES", "TILE_OVERHEAD_PAIRS", "choose_block_sizes", "tile_cost"]

# Largest first: ties go to the larger tiles. All are whole 64 x 64 granules, so one pass of
# the mask's predicate gives every candidate's layout (tfx.ops.sparse.LAYOUT_GRANULE).
CANDIDATES = ((BLOCK_Q, BLOCK_K), (128, 256), (128, 128), (64, 64))
# The fixed cost of a visited tile in pairs' worth of time, fitted to forward times of
# benchmarks/attention.py's sparse patterns (8 heads, head_dim 64, float32, N = 8192 and
# 16384) under every candidate: time ~ pairs + TILE_OVERHEAD_PAIRS x tiles.
TILE_OVERHEAD_PAIRS = 1536


def tile_cost(spec: SparsitySpec | None, q_len: int, kv_len: int, block_q: int,
              block_k: int) -> int:
    """The modelled cost, in pairs, of a blocked attention over [q_len, kv_len] with tiles
    block_q x block_k (each capped at its length) and static mask `spec`."""
    block_q, block_k = min(block_q, q_len), min(block_k, kv_len)
    if spec is None:
        tiles = -(-q_len // block_q) * -(-kv_len // block_k)
    else:
        tiles = int(spec.block_layout(q_len, kv_len, block_q, block_k).sum())
    return tiles * (block_q * block_k + TILE_OVERHEAD_PAIRS)


@functools.lru_cache(maxsize=128)
def choose_block_sizes(spec: SparsitySpec | None, q_len: int, kv_len: int) -> tuple[int, int]:
    """(block_q, block_k) of least `tile_cost` among CANDIDATES, capped at the lengths.

    Args:
      spec: the static mask (causal and sparse parts, `tfx.ops.attention.static_spec`), or
        None when every pair is visible.
      q_len, kv_len: the unpadded lengths, >= 1.
    """
    if spec is None:
        return min(BLOCK_Q, q_len), min(BLOCK_K, kv_len)
    block_q, block_k = min(CANDIDATES, key=lambda c: tile_cost(spec, q_len, kv_len, *c))
    return min(block_q, q_len), min(block_k, kv_len)
