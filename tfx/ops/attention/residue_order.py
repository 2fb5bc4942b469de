"""Tokens regrouped by their residue modulo a stride, so that strided pairs become tiles.

The Strided pattern of Child et al. 2019 lets query i see key j <= i when i - j < stride (the
local part) or when stride divides i - j (the strided part). In token order the strided part
puts one visible key every `stride` columns, so every tile below the diagonal holds some and a
blocked kernel visits them all: no tile size follows those pairs. Regrouped by residue, with
position i = a·stride + r moved to r·n + a (n = ceil(length / stride) tokens per residue), the
strided part is a strictly causal triangle on each of the `stride` diagonal blocks of n x n,
which tiles follow closely. `tfx.ops.attention.blocked_pieces` attends the local part in token order
and
the strided part in residue order, and merges the two by their log-sum-exp.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops.sparse import Causal, Intersection, SlidingWindow, SparsitySpec, Strided

__all__ = ["StridedHistory", "from_residue_order", "residue_length", "strided_parts",
           "to_residue_order"]


@dataclasses.dataclass(frozen=True)
class StridedHistory(SparsitySpec):
    """Strided(stride)'s strided part, on positions in residue order: query i sees key j when
    stride divides i - j and j < i (in token order), and j < kv_len.

    Positions are those of `to_residue_order` over the queries' and the keys' sequences padded
    to whole residues (q_len and kv_len are the token-order lengths); padded keys are hidden.
    """

    stride: int
    q_len: int
    kv_len: int

    def allows(self, q_pos, k_pos, kv_len):
        per_query_residue = -(-self.q_len // self.stride)
        per_key_residue = -(-self.kv_len // self.stride)
        query_residue, query_index = np.divmod(q_pos, per_query_residue)
        key_residue, key_index = np.divmod(k_pos, per_key_residue)
        key_token = key_index * self.stride + key_residue
        return (query_residue == key_residue) & (key_index < query_index) & (
            key_token < self.kv_len)


def strided_parts(spec: SparsitySpec | None) -> tuple[SlidingWindow, int] | None:
    """(the local window, the stride) when `spec` is Strided(stride), alone or with Causal
    (which it implies), and the stride is > 1; otherwise None."""
    parts = spec.parts if isinstance(spec, Intersection) else (spec,)
    strided = [p for p in parts if isinstance(p, Strided)]
    if len(strided) != 1 or any(not isinstance(p, Strided | Causal) for p in parts):
        return None
    stride = strided[0].stride
    return (SlidingWindow(stride), stride) if stride > 1 else None


def residue_length(length: int, stride: int) -> int:
    """A sequence of `length` tokens in residue order: padded to whole residues (a multiple of
    `stride`)."""
    return -(-length // stride) * stride


def to_residue_order(x: jax.Array, axis: int, stride: int) -> jax.Array:
    """x with its `axis` (a sequence of L tokens) padded with zeros to n·stride tokens, n =
    ceil(L / stride), and reordered so that token a·stride + r sits at r·n + a."""
    length = x.shape[axis]
    if stride == 1:
        return x
    per_residue = -(-length // stride)
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, per_residue * stride - length)
    x = jnp.pad(x, pads)
    x = x.reshape(*x.shape[:axis], per_residue, stride, *x.shape[axis + 1:])
    return jnp.swapaxes(x, axis, axis + 1).reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def from_residue_order(x: jax.Array, axis: int, stride: int, length: int) -> jax.Array:
    """The inverse of `to_residue_order` (x's `axis` holds whole residues): tokens back in
    order, the first `length` kept."""
    if stride > 1:
        x = x.reshape(*x.shape[:axis], stride, -1, *x.shape[axis + 1:])
        x = jnp.swapaxes(x, axis, axis + 1).reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])
    return jax.lax.slice_in_dim(x, 0, length, axis=axis)
