"""The TPU grouped matmul: jax's Pallas megablox `gmm` kernel behind tfx's row layout.

`gmm` multiplies rows sorted by group, group g's rows by rhs[g], tile by tile. It needs the row
count to be a multiple of the row tile and leaves the rows after the last group uninitialised
(NaN in interpret mode), so `grouped_matmul_megablox` pads the rows and zeroes those rows on
the way in and out: their values and gradients are exactly zero, as with `jax.lax.ragged_dot`.
The kernel compiles for TPU only; elsewhere it runs in Pallas interpret mode (slow: for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import megablox

__all__ = ["DTYPES", "check_available", "grouped_matmul_megablox"]

DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))  # what the kernel accepts
_TILE = 128  # the k and n tile: a multiple of the TPU lane width


def check_available(dtype, platform: str, interpret: bool) -> None:
    """ValueError unless the kernel can run: a TPU or `interpret=True`, and a dtype of DTYPES."""
    if platform != "tpu" and not interpret:
        raise ValueError(f"implementation='megablox' compiles for TPU only, but the platform is "
                         f"{platform!r}; pass interpret=True to run it in Pallas interpret mode "
                         f"(slow, for testing), or use implementation=None (this platform's "
                         f"default)")
    if np.dtype(dtype) not in DTYPES:
        raise ValueError(f"implementation='megablox' needs x of dtype float32 or bfloat16, got "
                         f"{np.dtype(dtype)}")


def grouped_matmul_megablox(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                            tile_rows: int = 128, interpret: bool = False) -> jax.Array:
    """out[rows of group g] = lhs[rows of group g] @ rhs[g]; rows after the last group are zero.

    Args:
      lhs: [rows, k], sorted by group (group g's rows follow group g - 1's), float32/bfloat16.
      rhs: [groups, k, n], lhs's dtype.
      group_sizes: int32 [groups], summing to at most rows.
      tile_rows: the kernel's row tile (a multiple of 8 on TPU; 16 for bfloat16).
      interpret: run the kernel in Pallas interpret mode (any platform).
    Returns:
      [rows, n] in lhs's dtype (accumulated in float32).
    """
    rows, k = lhs.shape
    padded = -(-rows // tile_rows) * tile_rows
    valid = (jnp.arange(padded) < jnp.sum(group_sizes))[:, None]
    lhs = jnp.where(valid, jnp.pad(lhs, ((0, padded - rows), (0, 0))), 0)
    # A tile no larger than the dim is either the whole dim or a lane multiple, as TPUs need.
    tiling = (tile_rows, min(k, _TILE), min(rhs.shape[2], _TILE))
    out = megablox.gmm(lhs, rhs, group_sizes.astype(jnp.int32),
                       preferred_element_type=lhs.dtype, tiling=tiling, interpret=interpret)
    return jnp.where(valid, out, 0)[:rows]
