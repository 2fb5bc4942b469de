"""Fixed sinusoidal position encodings (Vaswani et al., 2017)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops import _checks as checks

__all__ = ["sinusoidal"]

_LAYOUTS = ("interleaved", "concat")


@functools.partial(jax.jit, static_argnames=("dim", "layout", "base"))
def sinusoidal(
    positions: jax.Array, dim: int, *, layout: str = "interleaved", base: float = 10000.0
) -> jax.Array:
    """Sinusoidal encodings of (absolute or relative) positions.

    With frequencies w_i = base^(-2i/dim), i in [0, dim/2):
      layout "interleaved" (the paper): out[..., 2i] = sin(p·w_i), out[..., 2i+1] = cos(p·w_i);
      layout "concat" (Transformer-XL, tensor2tensor): out = [sin(p·w_0..) | cos(p·w_0..)].

    Args:
      positions: int or float array of any shape `[...]`.
      dim: even encoding width, >= 2.
      layout: "interleaved" or "concat".
      base: frequency base (10000 in the paper).
    Returns:
      float32 `[..., dim]`. Angles are computed in float32 whatever the positions' dtype.
    """
    if not any(jnp.issubdtype(positions.dtype, kind) for kind in (jnp.integer, jnp.floating)):
        raise TypeError(f"positions must have an integer or floating dtype, got {positions.dtype}")
    dim = checks.positive_int("dim", dim, minimum=2)
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    base = checks.positive_float("base", base)

    # Frequencies are trace-time constants: compute them in float64 and round once.
    inv_freq = (base ** (-np.arange(0, dim, 2) / dim)).astype(np.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if layout == "concat":
        return jnp.concatenate([sin, cos], axis=-1)
    return jnp.stack([sin, cos], axis=-1).reshape(*positions.shape, dim)
