"""Grouped matrix multiplication over row blocks: rows sorted by expert, each expert's group
padded to a multiple of the block size, every block multiplied by its own expert's matrix.

`jax.lax.ragged_dot` computes the same product, but on CPU XLA lowers it to every group's
matrix on every row (E times the work). Here a loop visits only the blocks in use, so the work
is the tokens' own plus the padding of the last block of each group. The backward pass is
written out (custom VJP) so that the weight gradient accumulates in place, block by block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["grouped_matmul"]


@jax.custom_vjp
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, block_expert: jax.Array,
                   used_blocks: jax.Array) -> jax.Array:
    """out[rows of block b] = lhs[rows of block b] @ rhs[block_expert[b]].

    Args:
      lhs: [rows, k], rows = num_blocks · block_size, sorted and padded by group.
      rhs: [groups, k, n].
      block_expert: int32 [num_blocks], the group of each block.
      used_blocks: int32 [], blocks from this index on are padding and come out zero.
    Returns:
      [rows, n] in lhs's dtype.
    """
    return _blockwise(lhs, rhs, block_expert, used_blocks, transpose=False)


def _blockwise(lhs, rhs, block_expert, used_blocks, *, transpose: bool):
    """Block b of lhs times rhs[block_expert[b]] (transposed: its [n, k] transpose)."""
    num_blocks = block_expert.shape[0]
    blocks = lhs.reshape(num_blocks, -1, lhs.shape[-1])
    width = rhs.shape[1] if transpose else rhs.shape[2]
    contract = 2 if transpose else 1  # contract over rhs's n (transpose) or k

    def body(b, out):
        matrix = jax.lax.dynamic_index_in_dim(rhs, block_expert[b], keepdims=False)
        product = jax.lax.dot_general(blocks[b], matrix, (((1,), (contract - 1,)), ((), ())))
        return jax.lax.dynamic_update_index_in_dim(out, product.astype(out.dtype), b, 0)

    out = jnp.zeros((num_blocks, blocks.shape[1], width), lhs.dtype)
    out = jax.lax.fori_loop(0, used_blocks, body, out)
    return out.reshape(-1, width)


def _forward(lhs, rhs, block_expert, used_blocks):
    out = _blockwise(lhs, rhs, block_expert, used_blocks, transpose=False)
    return out, (lhs, rhs, block_expert, used_blocks)


def _backward(residuals, d_out):
    lhs, rhs, block_expert, used_blocks = residuals
    d_lhs = _blockwise(d_out, rhs, block_expert, used_blocks, transpose=True)
    num_blocks = block_expert.shape[0]
    lhs_blocks = lhs.reshape(num_blocks, -1, lhs.shape[-1])
    d_out_blocks = d_out.reshape(num_blocks, -1, d_out.shape[-1])

    def accumulate(b, d_rhs):
        e = block_expert[b]
        update = jax.lax.dot_general(lhs_blocks[b], d_out_blocks[b], (((0,), (0,)), ((), ())))
        current = jax.lax.dynamic_index_in_dim(d_rhs, e, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(d_rhs, current + update.astype(d_rhs.dtype),
                                                   e, 0)

    d_rhs = jax.lax.fori_loop(0, used_blocks, accumulate, jnp.zeros_like(rhs))
    zeros = (jnp.zeros(block_expert.shape, jax.dtypes.float0),
             jnp.zeros(used_blocks.shape, jax.dtypes.float0))
    return (d_lhs, d_rhs, *zeros)


grouped_matmul.defvjp(_forward, _backward)
