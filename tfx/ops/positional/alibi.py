"""ALiBi: attention with linear biases (Press et al., 2022)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops import _checks as checks
from tfx.ops.positional.t5 import relative_positions

__all__ = ["alibi_bias", "alibi_slopes"]


def _geometric_slopes(num_heads: int) -> np.ndarray:
    return 2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)


@functools.partial(jax.jit, static_argnames=("num_heads",))
def alibi_slopes(num_heads: int) -> jax.Array:
    """Per-head ALiBi slopes.

    For a power of two n, slope_h = 2^(-8(h+1)/n) (n = 8: 1/2, 1/4, ..., 1/256). Otherwise the
    slopes of the largest power of two c < n come first, then every other slope of the 2c set
    (the paper's recipe; n = 12 appends 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5).

    Args:
      num_heads: >= 1.
    Returns:
      float32 `[num_heads]`.
    """
    num_heads = checks.positive_int("num_heads", num_heads)
    power_of_two = 1 << (num_heads.bit_length() - 1)
    # The slopes are trace-time constants: compute them in float64 and round once.
    slopes = np.concatenate(
        [
            _geometric_slopes(power_of_two),
            _geometric_slopes(2 * power_of_two)[0::2][: num_heads - power_of_two],
        ]
    )
    return jnp.asarray(slopes, jnp.float32)


@jax.jit
def alibi_bias(
    slopes: jax.Array, query_positions: jax.Array, key_positions: jax.Array
) -> jax.Array:
    """ALiBi additive attention bias: -slope·|i - j| for query position i and key position j.

    The paper writes -slope·(i - j) for the keys a causal query sees (j <= i), where the two
    agree; the absolute value extends it symmetrically to keys after the query, for
    bidirectional attention. Causal models still need their causal mask.

    Args:
      slopes: float `[heads]`, e.g. `alibi_slopes(heads)`.
      query_positions: int `[q_len]` or `[batch, q_len]`.
      key_positions: int `[kv_len]` or `[batch, kv_len]`, same rank as query_positions.
    Returns:
      float32 `[heads, q_len, kv_len]`, or `[batch, heads, q_len, kv_len]` for batched positions.
    """
    checks.floating("slopes", slopes, ndim=1, layout="[heads]")
    distance = jnp.abs(relative_positions(query_positions, key_positions)).astype(jnp.float32)
    return -slopes.astype(jnp.float32)[:, None, None] * distance[..., None, :, :]
