"""Layer and RMS normalisation over the last axis, as pure functions (`tfx.nn.norms`' layers
call them).

Statistics are computed in float32 at least, as Flax's layers do, and the variance the same
"fast" way, E[x²] - E[x]² (clipped at 0). The learned scale and bias are applied by
`tfx.ops.matmul.apply_scale` and `add_bias`, whose gradients sum over the rows as one
matrix-vector product: XLA:CPU without its YNNPACK fusions (how tfx's training step compiles
dense models) would otherwise turn each of those row sums into a tree of reduce-window ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tfx.ops import _checks
from tfx.ops.matmul import add_bias, apply_scale

__all__ = ["layer_norm", "rms_norm"]


@functools.partial(jax.jit, static_argnames=("epsilon", "dtype"))
def layer_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None, *,
               epsilon: float, dtype=None) -> jax.Array:
    """(x - mean) / sqrt(var + epsilon) · scale + bias over the last axis.

    Args:
      x: float [..., features].
      scale: [features] or None (no scale).
      bias: [features] or None (no bias).
      epsilon: float > 0, added to the variance.
      dtype: of the result; None: the promotion of x's and the parameters' dtypes (Flax's
        rule: a bfloat16 x with float32 parameters gives float32).
    Returns:
      [..., features].
    Raises:
      TypeError: for a non-floating x; ValueError: for epsilon <= 0, or a scale or bias that
        is not [features].
    """
    return _affine(_standardised(x, epsilon, centre=True), x.dtype, scale, bias, dtype)


@functools.partial(jax.jit, static_argnames=("epsilon", "dtype"))
def rms_norm(x: jax.Array, scale: jax.Array | None = None, *, epsilon: float,
             dtype=None) -> jax.Array:
    """x / sqrt(mean(x²) + epsilon) · scale over the last axis. Arguments, result and errors
    as `layer_norm`'s (without a bias)."""
    return _affine(_standardised(x, epsilon, centre=False), x.dtype, scale, None, dtype)


def _standardised(x: jax.Array, epsilon: float, *, centre: bool) -> jax.Array:
    """x [..., features] divided by its root mean square over the last axis (after taking
    the mean away when `centre`), in float32 or wider."""
    _checks.floating("x", x)
    epsilon = _checks.positive_float("epsilon", epsilon)
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    if not centre:
        return x * jax.lax.rsqrt(mean_square + epsilon)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.maximum(0.0, mean_square - jnp.square(mean))
    return (x - mean) * jax.lax.rsqrt(variance + epsilon)


def _affine(standardised, input_dtype, scale, bias, dtype) -> jax.Array:
    """scale and bias applied in the statistics' precision, the result cast to `dtype` (else
    the promotion of the input's and the parameters' dtypes)."""
    features = standardised.shape[-1]
    for name, param in (("scale", scale), ("bias", bias)):
        if param is not None and tuple(param.shape) != (features,):
            raise ValueError(f"{name} must be [features] = [{features}] (x's last axis), got "
                             f"shape {tuple(param.shape)}")
    params = [p for p in (scale, bias) if p is not None]
    if dtype is None:
        dtype = jnp.result_type(input_dtype, *params)
    y = standardised.astype(jnp.promote_types(standardised.dtype, dtype))
    if scale is not None:
        y = apply_scale(y, jnp.asarray(scale, y.dtype))
    if bias is not None:
        y = add_bias(y, jnp.asarray(bias, y.dtype))
    return y.astype(dtype)
