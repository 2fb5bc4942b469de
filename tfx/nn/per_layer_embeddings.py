"""Per-layer embeddings (Gemma 4's "PLE"): a second, narrow embedding of every token for every
layer, mixed with a projection of the main embedding, that each layer gates into its residual
stream after its MLP.

Two modules:
- `PerLayerEmbeddings` (once per model) turns ids and the main (scaled) embeddings
  [batch, seq, d_model] into per-layer inputs [batch, seq, num_layers, width]:
    tokens   = table[ids] · sqrt(width)                       (a [vocab, num_layers · width] table)
    context  = rms_norm(projection(embedded) · d_model**-0.5)  (normalised over each layer's width)
    inputs   = (context + tokens) · 2**-0.5
- `PerLayerInput` (once per layer) adds one layer's slice of them to the hidden state
  x [batch, seq, d_model]:
    x + rms_norm(up(activation(gate(x)) · input))              (gate: d_model -> width, up back)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn import axes
from tfx.nn.embeddings import TokenEmbedding
from tfx.nn.linear import flat_linear
from tfx.nn.norms import RMSNorm
from tfx.ops.activations import ACTIVATIONS

__all__ = ["PerLayerEmbeddings", "PerLayerInput"]


class PerLayerEmbeddings(nnx.Module):
    """The per-layer inputs of every layer, from the token ids and the main embeddings.

    Args:
      vocab_size: rows of the per-layer table (Hugging Face's vocab_size_per_layer_input).
      num_layers: layers that read a per-layer input.
      width: features of each layer's input (hidden_size_per_layer_input).
      d_model: width of the main embeddings.
      eps: epsilon of the RMSNorm over each layer's projected context.
      dtype: compute dtype (None: the inputs').
      param_dtype: storage dtype of the weights.
      rngs: parameter initialisation.
    """

    def __init__(self, vocab_size: int, num_layers: int, width: int, d_model: int, *,
                 eps: float, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        for name, value in (("vocab_size", vocab_size), ("num_layers", num_layers),
                            ("width", width), ("d_model", d_model)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_layers, self.width, self.d_model = num_layers, width, d_model
        kinds = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.tokens = TokenEmbedding(vocab_size, num_layers * width, **kinds)
        self.projection = flat_linear(d_model, num_layers * width, use_bias=False,
                                      kernel_metadata=axes.metadata(axes.EMBED, axes.MLP),
                                      **kinds)
        self.norm = RMSNorm(width, epsilon=eps, **kinds)

    def __call__(self, ids: jax.Array, embedded: jax.Array) -> jax.Array:
        """Per-layer inputs.

        Args:
          ids: int [batch, seq], token ids in [0, vocab_size).
          embedded: [batch, seq, d_model], the main embeddings of those ids (already scaled).
        Returns:
          [batch, seq, num_layers, width] in the dtype of `embedded`.
        """
        if embedded.shape[:2] != ids.shape or embedded.shape[-1] != self.d_model:
            raise ValueError(f"embedded must be [batch, seq, {self.d_model}] for ids of shape "
                             f"{ids.shape}, got {embedded.shape}")
        split = (*ids.shape, self.num_layers, self.width)
        tokens = self.tokens(ids)
        # The factor in the table's dtype, as transformers' scaled embedding casts it.
        tokens = (tokens * jnp.asarray(self.width**0.5, tokens.dtype)).reshape(split)
        context = self.projection(embedded) * self.d_model**-0.5
        context = self.norm(context.reshape(split))
        return ((context + tokens.astype(context.dtype)) * 2**-0.5).astype(embedded.dtype)


class PerLayerInput(nnx.Module):
    """One layer's use of its per-layer input: a gated, projected and normalised residual.

    Args:
      d_model: width of the hidden state.
      width: features of the per-layer input.
      activation: name in `tfx.ops.activations.ACTIVATIONS` applied to the gate.
      eps: epsilon of the RMSNorm of the projected output.
      dtype: compute dtype (None: the inputs').
      param_dtype: storage dtype of the weights.
      rngs: parameter initialisation.
    """

    def __init__(self, d_model: int, width: int, *, activation: str, eps: float, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got "
                             f"{activation!r}")
        self.activation = activation
        kinds = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = flat_linear(d_model, width, use_bias=False,
                                kernel_metadata=axes.metadata(axes.EMBED, axes.MLP), **kinds)
        self.up = flat_linear(width, d_model, use_bias=False,
                              kernel_metadata=axes.metadata(axes.MLP, axes.EMBED), **kinds)
        self.norm = RMSNorm(d_model, epsilon=eps, **kinds)

    def __call__(self, x: jax.Array, per_layer_input: jax.Array) -> jax.Array:
        """x [batch, seq, d_model] and this layer's input [batch, seq, width] -> x plus the
        normalised, projected, gated input, [batch, seq, d_model]."""
        h = ACTIVATIONS[self.activation](self.gate(x)) * per_layer_input.astype(x.dtype)
        return x + self.norm(self.up(h)).astype(x.dtype)
