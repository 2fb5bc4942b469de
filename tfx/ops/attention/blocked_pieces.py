"""A blocked attention as pieces over disjoint sets of pairs, merged by log-sum-exp.

Each piece attends its own pairs with tokens in its own order (token order, or regrouped by
residue: `tfx.ops.attention.residue_order`) on its own tiles. The pieces' outputs are merged as ring
attention merges chunks: out = sum_i exp(lse_i - lse) out_i with lse = log sum_i exp(lse_i),
and the backward pass runs each piece's blocked backward with the merged output and lse, whose
gradients sum to the full ones. One piece in token order is the plain blocked kernel.

Arrays use the blocked kernel's grouped layout, unpadded: query [B, K, G, T, D] (already
scaled), key [B, K, S, D], value [B, K, S, Dv], `ScoreInputs` mask [b, k, g, t, s] and segment
ids [B, T], [B, S].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tfx.ops.attention.block_plan import BlockPlan, block_plan
from tfx.ops.attention.blocked_attention import (
    ScoreInputs,
    blocked_attention,
    blocked_attention_backward,
    blocked_attention_forward,
)
from tfx.ops.attention.residue_order import from_residue_order, residue_length, to_residue_order
from tfx.ops.sparse import SparsitySpec

__all__ = ["Piece", "pieced_attention"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One pass: the pairs `spec` allows, with tokens in residue order modulo `stride` (1:
    token order; `spec` then sees positions in that order), on block_q x block_k tiles."""

    spec: SparsitySpec | None
    stride: int
    block_q: int
    block_k: int


def pieced_attention(query, key, value, inputs: ScoreInputs, pieces: tuple[Piece, ...],
                     softcap: float | None) -> jax.Array:
    """float32 [B, K, G, T, Dv]: attention over the union of the pieces' pairs (disjoint).

    One piece may come with a bias or sinks; several need both None (their merged backward
    gives no gradient for them, and the merge would count a sink once per piece).
    """
    if len(pieces) == 1:
        piece = pieces[0]
        args, plan = _into(piece, query, key, value, inputs)
        out = blocked_attention(*args, plan=plan, block_q=piece.block_q, block_k=piece.block_k,
                                softcap=softcap)
        return _out_of(piece, out, 3, query.shape[3])
    if inputs.bias is not None or inputs.sinks is not None:
        raise ValueError("pieced attention takes no bias or sinks: its backward has no gradient "
                         "for them")
    return _merged(pieces, softcap, query, key, value, inputs)


def _into(piece: Piece, query, key, value, inputs: ScoreInputs):
    """The piece's (query, key, value, inputs) in its token order, padded to whole tiles, and
    its plan."""
    stride, (block_q, block_k) = piece.stride, (piece.block_q, piece.block_k)
    q_len, kv_len = residue_length(query.shape[3], stride), residue_length(key.shape[2], stride)

    def along(x, axis, block):
        return _pad(to_residue_order(x, axis, stride), axis, block)

    def scores_along(x):  # bias and mask: their dims of 1 broadcast
        for axis, block in ((3, block_q), (4, block_k)):
            x = x if x.shape[axis] == 1 else along(x, axis, block)
        return x

    query = along(query, 3, block_q)
    key, value = along(key, 2, block_k), along(value, 2, block_k)
    bias, mask = (None if x is None else scores_along(x) for x in (inputs.bias, inputs.mask))
    segments = (None if x is None else along(x, 1, block)
                for x, block in ((inputs.query_segments, block_q),
                                 (inputs.key_segments, block_k)))
    plan = block_plan(piece.spec, q_len, kv_len, block_q, block_k)
    return (query, key, value, ScoreInputs(bias, mask, *segments, sinks=inputs.sinks)), plan


def _pad(x: jax.Array, axis: int, block: int) -> jax.Array:
    """x padded with zeros along `axis` to a multiple of `block`."""
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, -x.shape[axis] % block)
    return jnp.pad(x, pads)


def _out_of(piece: Piece, x: jax.Array, axis: int, length: int) -> jax.Array:
    """A result of the piece's padded layout back in token order, cut to `length` tokens."""
    padded = residue_length(length, piece.stride)
    return from_residue_order(jax.lax.slice_in_dim(x, 0, padded, axis=axis), axis, piece.stride,
                              length)


def _run(piece: Piece, plan: BlockPlan, softcap, kernel, *args):
    return kernel(*args, plan=plan, block_q=piece.block_q, block_k=piece.block_k,
                  softcap=softcap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _merged(pieces, softcap, query, key, value, inputs):
    return _merged_forward(pieces, softcap, query, key, value, inputs)[0]


def _merged_forward(pieces, softcap, query, key, value, inputs):
    q_len = query.shape[3]
    outs, sums = [], []
    for piece in pieces:
        args, plan = _into(piece, query, key, value, inputs)
        out, log_sum_exp = _run(piece, plan, softcap, blocked_attention_forward, *args)
        outs.append(_out_of(piece, out, 3, q_len))
        sums.append(_out_of(piece, log_sum_exp, 3, q_len))
    log_sum_exp = functools.reduce(jnp.logaddexp, sums)
    out = sum(jnp.exp(s - log_sum_exp)[..., None] * o for s, o in zip(sums, outs, strict=True))
    return out, (query, key, value, inputs, out, log_sum_exp)


def _merged_backward(pieces, softcap, residuals, d_out):
    query, key, value, inputs, out, log_sum_exp = residuals
    grads = [jnp.zeros(x.shape, jnp.float32) for x in (query, key, value)]
    for piece in pieces:
        args, plan = _into(piece, query, key, value, inputs)
        # Padded rows get out = d_out = 0 and lse = 0: with their zero queries every score is
        # 0 or hidden, so they add nothing (and no inf) to dK and dV.
        merged = (_pad(to_residue_order(x, 3, piece.stride), 3, piece.block_q)
                  for x in (out, log_sum_exp, d_out.astype(jnp.float32)))
        parts = _run(piece, plan, softcap, blocked_attention_backward, *args, *merged)
        lengths = (query.shape[3], key.shape[2], value.shape[2])
        grads = [g + _out_of(piece, p, axis, n)
                 for g, p, axis, n in zip(grads, parts, (3, 2, 2), lengths, strict=True)]
    return (*(g.astype(x.dtype) for g, x in zip(grads, (query, key, value), strict=True)),
            None)


_merged.defvjp(_merged_forward, _merged_backward)
