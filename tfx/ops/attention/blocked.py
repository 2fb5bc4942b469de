"""The blocked attention kernel: online softmax over tiles, O(q_len + kv_len) memory, skipping
the tiles that the static mask, sparsity, key padding or segment ids leave empty
(`tfx.ops.attention.blocked_pieces`; tiles chosen by `tfx.ops.attention.tile_sizes`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfx.ops.attention.blocked_attention import ScoreInputs
from tfx.ops.attention.blocked_pieces import Piece, pieced_attention
from tfx.ops.attention.kernel import Call, Kernel, scores_at_least
from tfx.ops.attention.reference import grouped
from tfx.ops.attention.tile_sizes import choose_block_sizes, choose_pieces

__all__ = ["BLOCKED_MIN_SCORES", "KERNEL"]

# The score-matrix size from which tfx's blocked kernel beats the reference path (measured on
# CPU with benchmarks/attention.py: between 512² (reference faster) and 1024² (blocked ~2x)).
BLOCKED_MIN_SCORES = 2**19


def _run(call: Call) -> jax.Array:
    """The caller's tiles in one pass, else the kernel's own choice of pieces."""
    spec, (q_len, kv_len) = call.spec, (call.query.shape[1], call.key.shape[1])
    if call.block_sizes is not None:
        pieces = (Piece(spec, 1, *call.block_sizes),)
    elif call.bias is not None or call.sinks is not None:  # pieces merge without their gradients
        pieces = (Piece(spec, 1, *choose_block_sizes(spec, q_len, kv_len)),)
    else:
        pieces = choose_pieces(spec, q_len, kv_len)
    return _blocked(call.query, call.key, call.value, call.bias, call.mask, call.segments,
                    (call.scale, call.softcap), pieces, call.sinks)


def _blocked(query, key, value, bias, mask, segments, scores, pieces, sinks=None):
    """Regroup heads, run the blocked kernel's pieces (`tfx.ops.attention.blocked_pieces`), and
    undo the grouping; scores: (scale, softcap or None); sinks: [num_heads] or None."""
    scale, softcap = scores
    batch, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    grouped_query = (query * jnp.asarray(scale, query.dtype)).reshape(
        batch, q_len, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    key, value = (x.transpose(0, 2, 1, 3) for x in (key, value))
    bias, mask = (None if x is None else grouped(x, num_kv_heads) for x in (bias, mask))
    if sinks is not None:
        sinks = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    out = pieced_attention(grouped_query, key, value,
                           ScoreInputs(bias, mask, *segments, sinks=sinks), pieces, softcap)
    out = out.transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, num_heads, value.shape[-1]).astype(value.dtype)


# Small problems are faster in one fused piece (the reference kernel).
KERNEL = Kernel("blocked", _run, when=scores_at_least(BLOCKED_MIN_SCORES))
