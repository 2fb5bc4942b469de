"""Normalisation layers by name: LayerNorm (BERT, GPT-2) and RMSNorm (LLaMA, T5).

Both are subclasses of Flax's layers with the same parameters, settings and checkpoint layout.
Only where the learned scale and bias are applied changes: by `tfx.ops.matmul.apply_scale` and
`add_bias`, whose gradients sum over the rows as a matrix-vector product. XLA:CPU without its
YNNPACK fusions (how tfx's training step compiles dense models) otherwise turns each of those
row sums into a tree of reduce-window ops (see `tfx.ops.matmul`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.ops.matmul import add_bias, apply_scale

__all__ = ["NORMS", "LayerNorm", "RMSNorm", "make_norm"]

NORMS = ("layer", "rms")


class LayerNorm(nnx.LayerNorm):
    """`nnx.LayerNorm` over the last axis: (x - mean) / sqrt(var + epsilon) · scale + bias,
    statistics in float32 at least (Flax's "fast variance", E[x²] - E[x]²)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return _affine(self, x.dtype, _normalized(x, self.epsilon, centre=True))


class RMSNorm(nnx.RMSNorm):
    """`nnx.RMSNorm` over the last axis: x / sqrt(mean(x²) + epsilon) · scale, statistics in
    float32 at least."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return _affine(self, x.dtype, _normalized(x, self.epsilon, centre=False))


def _normalized(x: jax.Array, epsilon: float, *, centre: bool) -> jax.Array:
    """x [..., features] standardised over its last axis, in float32 or wider (x's dtype)."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    if not centre:
        return x * jax.lax.rsqrt(mean_square + epsilon)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.maximum(0.0, mean_square - jnp.square(mean))
    return (x - mean) * jax.lax.rsqrt(variance + epsilon)


def _affine(norm: nnx.LayerNorm | nnx.RMSNorm, input_dtype, normalized: jax.Array) -> jax.Array:
    """The norm's scale (and bias) applied to `normalized` in its precision, returned in the
    dtype Flax's layer returns: its `dtype`, else the promotion of the input's and the
    parameters'."""
    params = [p[...] for p in (norm.scale, getattr(norm, "bias", None)) if p is not None]
    dtype = norm.dtype or jnp.result_type(input_dtype, *params)
    y = normalized.astype(jnp.promote_types(normalized.dtype, dtype))
    if norm.scale is not None:
        y = apply_scale(y, norm.scale[...].astype(y.dtype))
    if getattr(norm, "bias", None) is not None:
        y = add_bias(y, norm.bias[...].astype(y.dtype))
    return y.astype(dtype)


def make_norm(kind: str, d_model: int, *, epsilon: float, dtype=None, param_dtype=jnp.float32,
              rngs: nnx.Rngs) -> nnx.Module:
    """A LayerNorm (scale and bias) or an RMSNorm (scale only); statistics in float32.

    `epsilon` has no default on purpose: BERT uses 1e-12, GPT-2 1e-5, LLaMA 1e-5/1e-6, T5 1e-6,
    and Flax's own default (1e-6) silently differs from most of them.
    """
    if kind == "layer":
        return LayerNorm(d_model, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)
    if kind == "rms":
        return RMSNorm(d_model, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                       rngs=rngs)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
