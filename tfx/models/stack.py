"""What every family shares: the input embeddings and a stack of layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models.block import Block, dtypes
from tfx.models.config import EncoderConfig, TransformerConfig
from tfx.nn.dropout import make_dropout
from tfx.nn.embeddings import LearnedPositions, SinusoidalPositions, TokenEmbedding
from tfx.nn.norms import make_norm
from tfx.nn.relative_bias import RelativePositionBias
from tfx.ops.sparse import SlidingWindow

__all__ = ["Embeddings", "Stack"]


class Embeddings(nnx.Module):
    """Token embedding, plus absolute positions and token types where the config has them.

    Post-norm models (BERT) normalise the sum, as BERT does; dropout follows.
    """

    def __init__(self, config: TransformerConfig, *, tokens: TokenEmbedding | None = None,
                 rngs: nnx.Rngs):
        c, kinds = config, dtypes(config)
        self.tokens = tokens or TokenEmbedding(c.vocab_size, c.d_model, rngs=rngs, **kinds)
        positions = None
        if c.position == "learned":
            positions = LearnedPositions(c.max_len, c.d_model, rngs=rngs, **kinds)
        elif c.position == "sinusoidal":
            positions = SinusoidalPositions(c.d_model, dtype=kinds["dtype"])
        self.positions = positions
        self.token_types = (TokenEmbedding(c.type_vocab_size, c.d_model, rngs=rngs, **kinds)
                            if isinstance(c, EncoderConfig) else None)
        self.norm = None if c.pre_norm else make_norm(c.norm, c.d_model, epsilon=c.norm_eps,
                                                      rngs=rngs, **kinds)
        self.dropout = make_dropout(c.dropout, rngs=rngs)

    def __call__(self, input_ids: jax.Array, positions: jax.Array,
                 token_type_ids: jax.Array | None = None) -> jax.Array:
        """int [batch, seq] -> [batch, seq, d_model]."""
        x = self.tokens(input_ids)
        if self.positions is not None:
            x = x + self.positions(positions)
        if self.token_types is not None:
            types = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + self.token_types(types)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


class Stack(nnx.Module):
    """Layers, T5's shared relative bias (owned by the stack, computed once, reused by every
    layer), and the final norm of pre-norm models.

    Layers are a list of Blocks (parameter paths `layers/<i>/...`), or with `scan_layers` one
    Block with stacked weights (`layers/...`, leading axis num_layers) run under `nnx.scan`,
    which compiles one layer instead of num_layers.

    Args:
      config: the model config; `num_layers` overrides its layer count (T5's decoder).
      causal: decoder self-attention (also picks T5's unidirectional buckets).
      cross_attention: every layer also attends to an encoder output.
    """

    def __init__(self, config: TransformerConfig, *, causal: bool, cross_attention: bool = False,
                 num_layers: int | None = None, rngs: nnx.Rngs):
        c, kinds = config, dtypes(config)
        self.causal, self.remat = causal, c.remat
        self.sliding_window = getattr(c, "sliding_window", None)
        self.relative_bias = (RelativePositionBias(
            c.num_heads, bidirectional=not causal, num_buckets=c.t5_num_buckets,
            max_distance=c.t5_max_distance, param_dtype=kinds["param_dtype"], rngs=rngs)
            if c.position == "t5" else None)
        count = c.num_layers if num_layers is None else num_layers
        self.scan_layers = c.scan_layers
        if c.scan_layers:
            # One Block whose weights carry a leading [num_layers] axis, compiled once.
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs):
                return Block(c, cross_attention=cross_attention, rngs=rngs)

            self.layers = stacked(rngs)
        else:
            self.layers = nnx.List([Block(c, cross_attention=cross_attention, rngs=rngs)
                                    for _ in range(count)])
        self.final_norm = (make_norm(c.norm, c.d_model, epsilon=c.norm_eps, rngs=rngs, **kinds)
                           if c.pre_norm else None)
        self.dropout = make_dropout(c.dropout, rngs=rngs)

    def __call__(self, x: jax.Array, *, positions: jax.Array, mask: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, context: jax.Array | None = None,
                 context_mask: jax.Array | None = None) -> jax.Array:
        """[batch, seq, d_model] -> [batch, seq, d_model].

        Args:
          positions: int [batch, seq] or [seq], true token positions (RoPE, ALiBi, T5 bias).
          mask: bool key mask broadcastable to [batch, heads, seq, seq] (padding), combined with
            the causal mask and sliding window of the config.
          segment_ids: int [batch, seq] for packed sequences.
          context, context_mask: encoder output and its mask for cross-attention.
        """
        bias = None
        if self.relative_bias is not None:
            bias = self.relative_bias(positions, positions)
        # A sliding window is itself causal (Mistral); otherwise a decoder is plainly causal.
        sparsity = None
        if self.causal and self.sliding_window is not None:
            sparsity = SlidingWindow(self.sliding_window)
        args = dict(mask=mask, bias=bias, is_causal=self.causal and sparsity is None,
                    sparsity=sparsity, positions=positions, query_segment_ids=segment_ids,
                    context=context, context_mask=context_mask)

        def run(h, block):
            return block(h, **args)

        run = nnx.remat(run) if self.remat else run
        if self.scan_layers:
            x = nnx.scan(run, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.layers)
        else:
            for layer in self.layers:
                x = run(x, layer)
        if self.final_norm is not None:
            x = self.dropout(self.final_norm(x))
        return x
