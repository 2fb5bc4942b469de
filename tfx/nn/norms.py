"""Normalisation layers by name: LayerNorm (BERT, GPT-2) and RMSNorm (LLaMA, T5)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

__all__ = ["NORMS", "make_norm"]

NORMS = ("layer", "rms")


def make_norm(kind: str, d_model: int, *, epsilon: float, dtype=None, param_dtype=jnp.float32,
              rngs: nnx.Rngs) -> nnx.Module:
    """A LayerNorm (scale and bias) or an RMSNorm (scale only); statistics in float32.

    `epsilon` has no default on purpose: BERT uses 1e-12, GPT-2 1e-5, LLaMA 1e-5/1e-6, T5 1e-6,
    and Flax's own default (1e-6) silently differs from most of them.
    """
    if kind == "layer":
        return nnx.LayerNorm(d_model, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                             rngs=rngs)
    if kind == "rms":
        return nnx.RMSNorm(d_model, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
