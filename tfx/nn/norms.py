"""Normalisation layers by name: LayerNorm (BERT, GPT-2) and RMSNorm (LLaMA, T5); `QKNorm`, the
RMSNorm of projected queries and keys (Qwen 3, Gemma 3, OLMo 2).

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

__all__ = ["NORMS", "QK_NORMS", "LayerNorm", "QKNorm", "RMSNorm", "make_norm"]

NORMS, QK_NORMS = names.NORMS, names.QK_NORMS


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


def make_norm(kind: str, d_model: int, *, epsilon: float, bias: bool = True, dtype=None,
              param_dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.Module:
    """A LayerNorm (scale, and bias unless `bias` is False) or an RMSNorm (scale only);
    statistics in float32.

    `epsilon` has no default on purpose: BERT uses 1e-12, GPT-2 1e-5, LLaMA 1e-5/1e-6, T5 1e-6,
    and Flax's own default (1e-6) silently differs from most of them.
    """
    if kind == "layer":
        return LayerNorm(d_model, epsilon=epsilon, use_bias=bias, dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs)
    if kind == "rms":
        return RMSNorm(d_model, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                       rngs=rngs)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


class QKNorm(nnx.Module):
    """RMSNorm of projected queries or keys [batch, seq, heads · head_dim]: over each head's
    head_dim features ("per_head", one scale [head_dim] shared by the heads) or over all
    features at once ("across_heads", a scale [heads · head_dim])."""

    def __init__(self, kind: str, num_heads: int, head_dim: int, eps: float, dtype, param_dtype,
                 rngs: nnx.Rngs):
        if kind not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS} or None, got {kind!r}")
        self.width = head_dim if kind == "per_head" else num_heads * head_dim
        self.norm = make_norm("rms", self.width, epsilon=eps, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        groups = x.reshape(*x.shape[:-1], -1, self.width)
        return self.norm(groups).reshape(x.shape)
