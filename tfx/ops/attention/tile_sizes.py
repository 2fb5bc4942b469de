"""The blocked kernel's tile sizes, chosen per call from the static mask.

A visited tile costs all its pairs, visible or not. Large tiles cost least per pair (fewer key-
loop steps and running-softmax updates, larger matmuls); small tiles skip more invisible pairs.
So the kernel takes, among `PAIR_COST`'s tile sizes, the one of least modelled time

    visited tiles x block_q x block_k x PAIR_COST[(block_q, block_k)]

read off the exact block layout of the static mask (`SparsitySpec.block_layout`). Without a
static mask, and for causal attention, that is the default 256 x 512 tiles; 64 x 64 tiles win
where a sparse mask leaves most of a large tile empty: BigBird's 64-key random blocks and
global tokens, a window much narrower than a tile.

A strided pattern's strided pairs fill no tile in token order, so `choose_pieces` also models it
as two pieces (`tfx.ops.attention.blocked_pieces`): its local window in token order and its strided
pairs in residue order (`tfx.ops.attention.residue_order`), each on its own tiles, and takes the
pieces
when they cost less than the one pass.
"""

from __future__ import annotations

import functools

from tfx.ops.attention.blocked_attention import BLOCK_K, BLOCK_Q
from tfx.ops.attention.blocked_pieces import Piece
from tfx.ops.attention.residue_order import StridedHistory, residue_length, strided_parts
from tfx.ops.sparse import SparsitySpec

__all__ = ["PAIR_COST", "choose_block_sizes", "choose_pieces", "modelled_cost", "strided_pieces",
           "visited_pairs"]

# The time of one visited pair on each tile size, relative to the default tiles, measured by
# benchmarks/tile_sizes.py on this project's CPU (8 heads of 64, float32; causal N = 1024-4096
# forward and forward+backward, BigBird, strided-128 and windows of 256 and 1024 at N = 8192):
# 64 x 64 tiles cost 1.1-2.6x per pair (1.6: about the middle of the sparse forward cases).
# 128 x 128 and 128 x 256 tiles cost as much per pair as 64 x 64 ones while skipping less, so
# they are not candidates. All sizes are whole 64 x 64 granules: one pass of the mask's
# predicate gives every layout (tfx.ops.sparse.LAYOUT_GRANULE).
PAIR_COST = {(BLOCK_Q, BLOCK_K): 1.0, (64, 64): 1.6}


def modelled_cost(spec: SparsitySpec, q_len: int, kv_len: int, block_q: int,
                  block_k: int) -> float:
    """Visited pairs x PAIR_COST of a blocked attention over [q_len, kv_len] with static mask
    `spec` on block_q x block_k tiles (a key of PAIR_COST; each capped at its length)."""
    weight = PAIR_COST[(block_q, block_k)]
    block_q, block_k = min(block_q, q_len), min(block_k, kv_len)
    tiles = int(spec.block_layout(q_len, kv_len, block_q, block_k).sum())
    return tiles * block_q * block_k * weight


@functools.lru_cache(maxsize=128)
def choose_block_sizes(spec: SparsitySpec | None, q_len: int, kv_len: int) -> tuple[int, int]:
    """(block_q, block_k) of least `modelled_cost` among PAIR_COST's sizes (the default tiles
    on a tie), capped at the lengths.

    Args:
      spec: the static mask (causal and sparse parts, `tfx.ops.attention.static_spec`), or
        None when every pair is visible.
      q_len: the unpadded query length, >= 1.
      kv_len: the unpadded key length, >= 1.
    """
    if spec is None:
        return min(BLOCK_Q, q_len), min(BLOCK_K, kv_len)
    return _cheapest(spec, q_len, kv_len)[1]


@functools.lru_cache(maxsize=128)
def choose_pieces(spec: SparsitySpec | None, q_len: int, kv_len: int) -> tuple[Piece, ...]:
    """The passes of least modelled cost for a blocked attention with static mask `spec`: one
    piece in token order on `choose_block_sizes`' tiles, or `strided_pieces` when they cost
    less.

    Args: as `choose_block_sizes`.

    The model leaves out the pieces' residue reorders (a pass over query, key, value and the
    output each). Measured against one pass (8 heads of 64, float32, causal strided): forward
    and backward 1.2-4.2x faster in all six cases from N = 512 (stride 32) to N = 4096
    (strides 64, 128); the forward alone 1.6-3.3x faster in four, and 0.87x and 0.95x as fast
    in two (N = 512, stride 32; N = 1024, stride 128).
    """
    whole = (Piece(spec, 1, *choose_block_sizes(spec, q_len, kv_len)),)
    split = strided_pieces(spec, q_len, kv_len)
    if split is None:
        return whole
    split_cost = sum(_cheapest(p.spec, *_lengths(p.stride, q_len, kv_len))[0] for p in split)
    return split if split_cost < _cheapest(spec, q_len, kv_len)[0] else whole


def strided_pieces(spec: SparsitySpec | None, q_len: int,
                   kv_len: int) -> tuple[Piece, Piece] | None:
    """A strided pattern as its local window in token order and its strided pairs in residue
    order, each on the tiles `choose_block_sizes` picks for it; None for other specs."""
    split = strided_parts(spec)
    if split is None:
        return None
    window, stride = split
    history = StridedHistory(stride, q_len, kv_len)
    return (Piece(window, 1, *choose_block_sizes(window, q_len, kv_len)),
            Piece(history, stride, *choose_block_sizes(history,
                                                       *_lengths(stride, q_len, kv_len))))


def visited_pairs(spec: SparsitySpec, q_len: int, kv_len: int) -> int:
    """The (query, key) pairs a blocked attention with static mask `spec` (and no bias)
    computes: the tiles that `choose_pieces`' pieces visit, times their size."""
    return sum(int(p.spec.block_layout(*_lengths(p.stride, q_len, kv_len), p.block_q,
                                       p.block_k).sum()) * p.block_q * p.block_k
               for p in choose_pieces(spec, q_len, kv_len))


@functools.lru_cache(maxsize=256)
def _cheapest(spec: SparsitySpec, q_len: int, kv_len: int) -> tuple[float, tuple[int, int]]:
    """(modelled cost, tiles capped at the lengths) of PAIR_COST's cheapest size (the first
    of equal costs)."""
    cost, (block_q, block_k) = min(((modelled_cost(spec, q_len, kv_len, *size), size)
                                    for size in PAIR_COST), key=lambda c: c[0])
    return cost, (min(block_q, q_len), min(block_k, kv_len))


def _lengths(stride: int, q_len: int, kv_len: int) -> tuple[int, int]:
    """The sequence lengths in residue order modulo `stride`: padded to whole residues."""
    return residue_length(q_len, stride), residue_length(kv_len, stride)
