"""Normalisation layers by name: LayerNorm (BERT, GPT-2) and RMSNorm (LLaMA, T5).

Both are subclasses of Flax's layers with the same parameters, settings and checkpoint layout,
whose call is `tfx.ops.norms`' function: the same maths, with the scale and bias gradients
computed as matrix-vector products (why, there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx import names
from tfx.ops.norms import layer_norm, rms_norm

__all__ = ["NORMS", "LayerNorm", "RMSNorm", "make_norm"]

NORMS = names.NORMS


class LayerNorm(nnx.LayerNorm):
    """`nnx.LayerNorm` over the last axis, computed by `tfx.ops.norms.layer_norm`."""

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., features] -> [..., features] in `dtype` (else x's and the parameters')."""
        return layer_norm(x, _value(self.scale), _value(self.bias), epsilon=self.epsilon,
                          dtype=self.dtype)


class RMSNorm(nnx.RMSNorm):
    """`nnx.RMSNorm` over the last axis, computed by `tfx.ops.norms.rms_norm`."""

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., features] -> [..., features] in `dtype` (else x's and the parameters')."""
        return rms_norm(x, _value(self.scale), epsilon=self.epsilon, dtype=self.dtype)


def _value(param: nnx.Param | None) -> jax.Array | None:
    return None if param is None else param[...]


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
