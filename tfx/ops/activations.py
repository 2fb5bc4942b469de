"""Activation functions by the names that configs use."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["ACTIVATIONS", "softcap"]

ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # exact erf GELU (BERT)
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GPT-2's "gelu_new"
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap · tanh(x / cap), elementwise: x squashed smoothly into (-cap, cap), nearly the
    identity for |x| << cap (Gemma 2's logit soft-capping); x itself when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)
