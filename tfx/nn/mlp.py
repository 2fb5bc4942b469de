"""Position-wise feed-forward blocks: plain (GELU / ReLU) and gated (SwiGLU / GeGLU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn import axes
from tfx.nn.dropout import make_dropout
from tfx.nn.linear import flat_linear
from tfx.ops.activations import ACTIVATIONS

__all__ = ["ACTIVATIONS", "MLP"]


class MLP(nnx.Module):
    """down(act(up(x))), or down(act(gate(x)) * up(x)) when `gated` (SwiGLU: silu, GeGLU: gelu).

    Args:
      d_model: model width (input and output).
      d_ff: hidden width.
      activation: a key of ACTIVATIONS.
      gated: the gated form (LLaMA, Mistral, T5 v1.1) with a third projection.
      use_bias: biases on the projections (GPT-2, BERT: True; LLaMA, T5: False).
      dropout: rate applied to the hidden activations (T5) — 0 disables it.
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "gelu", gated: bool = False,
                 use_bias: bool = True, dropout: float = 0.0, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation

        def linear(features_in, features_out, kernel_axes, bias_axes):
            return flat_linear(features_in, features_out, use_bias=use_bias, dtype=dtype,
                               param_dtype=param_dtype, kernel_metadata=axes.metadata(*kernel_axes),
                               bias_metadata=axes.metadata(*bias_axes), rngs=rngs)

        # Megatron: up/gate split their output (d_ff) dim, down its input dim; down's bias
        # over d_model declares no axes (replicated).
        self.up = linear(d_model, d_ff, (axes.EMBED, axes.MLP), (axes.MLP,))
        self.gate = linear(d_model, d_ff, (axes.EMBED, axes.MLP), (axes.MLP,)) if gated else None
        self.down = linear(d_ff, d_model, (axes.MLP, axes.EMBED), ())
        self.dropout = make_dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[batch, seq, d_model] -> [batch, seq, d_model]."""
        act = ACTIVATIONS[self.activation]
        hidden = act(self.up(x)) if self.gate is None else act(self.gate(x)) * self.up(x)
        return self.down(self.dropout(hidden))
