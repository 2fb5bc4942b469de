"""Activation functions by the names that configs use."""

from __future__ import annotations

import functools

import jax

__all__ = ["ACTIVATIONS"]

ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # exact erf GELU (BERT)
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GPT-2's "gelu_new"
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}
