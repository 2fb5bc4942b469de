"""T5's learned relative position bias as an NNX module (one table per stack, shared by its
layers, as T5 does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.ops.positional import t5_relative_bias

__all__ = ["RelativePositionBias"]


class RelativePositionBias(nnx.Module):
    """A [num_buckets, num_heads] table indexed by T5's bucket of key - query position.

    Args:
      num_heads: heads of the attention it biases.
      bidirectional: True in encoders, False in causal decoders.
      num_buckets: T5's number of buckets (32 by default).
      max_distance: T5's largest distance with its own buckets (128 by default).
    """

    def __init__(self, num_heads: int, *, bidirectional: bool, num_buckets: int = 32,
                 max_distance: int = 128, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.bidirectional, self.max_distance = bidirectional, max_distance
        init = jax.nn.initializers.normal(1.0)
        self.table = nnx.Param(init(rngs.params(), (num_buckets, num_heads), param_dtype))

    def __call__(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        """int [q_len] / [kv_len] (or batched) -> float [1 or batch, heads, q_len, kv_len]."""
        bias = t5_relative_bias(self.table[...], query_positions, key_positions,
                                bidirectional=self.bidirectional, max_distance=self.max_distance)
        return bias if bias.ndim == 4 else bias[None]
