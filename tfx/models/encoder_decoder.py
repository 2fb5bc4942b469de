"""Encoder–decoder: T5 and the original Transformer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models.block import dtypes
from tfx.models.config import EncoderDecoderConfig
from tfx.models.decoder import _check_ids
from tfx.models.stack import Embeddings, Stack
from tfx.nn.embeddings import TokenEmbedding
from tfx.ops.masks import padding_mask

__all__ = ["EncoderDecoder"]


class EncoderDecoder(nnx.Module):
    """Shared token embedding; a bidirectional encoder; a causal decoder whose every layer also
    attends to the encoder output; output head tied (scaled by d_model**-0.5 for T5) or not.

    Call it like Hugging Face's T5ForConditionalGeneration:
    `logits = model(input_ids, attention_mask=mask, decoder_input_ids=ids)`.
    """

    def __init__(self, config: EncoderDecoderConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, EncoderDecoderConfig):
            raise TypeError(f"config must be an EncoderDecoderConfig, got {type(config).__name__}")
        c, kinds = config, dtypes(config)
        self.config = config
        tokens = TokenEmbedding(c.vocab_size, c.d_model, rngs=rngs, **kinds)
        self.encoder_embeddings = Embeddings(c, tokens=tokens, rngs=rngs)
        self.decoder_embeddings = Embeddings(c, tokens=tokens, rngs=rngs)
        self.encoder = Stack(c, causal=False, rngs=rngs)
        self.decoder = Stack(c, causal=True, cross_attention=True,
                             num_layers=c.decoder_layers, rngs=rngs)
        self.head = (None if c.tie_embeddings else
                     nnx.Linear(c.d_model, c.vocab_size, use_bias=False, rngs=rngs, **kinds))

    def __call__(self, input_ids: jax.Array, *, decoder_input_ids: jax.Array,
                 attention_mask: jax.Array | None = None,
                 decoder_attention_mask: jax.Array | None = None) -> jax.Array:
        """Decoder logits, float32 [batch, target_len, vocab_size] (teacher forcing)."""
        encoded = self.encode(input_ids, attention_mask=attention_mask)
        return self.decode(decoder_input_ids, encoded, attention_mask=attention_mask,
                           decoder_attention_mask=decoder_attention_mask)

    def encode(self, input_ids: jax.Array, *, attention_mask: jax.Array | None = None):
        """int [batch, src_len] -> encoder output [batch, src_len, d_model]."""
        _check_ids(input_ids)
        positions = jnp.arange(input_ids.shape[1])
        mask = None if attention_mask is None else padding_mask(attention_mask.astype(bool))
        return self.encoder(self.encoder_embeddings(input_ids, positions), positions=positions,
                            mask=mask)

    def decode(self, decoder_input_ids: jax.Array, encoded: jax.Array, *,
               attention_mask: jax.Array | None = None,
               decoder_attention_mask: jax.Array | None = None) -> jax.Array:
        """Decoder tokens and encoder output -> float32 logits [batch, target_len, vocab]."""
        _check_ids(decoder_input_ids)
        positions = jnp.arange(decoder_input_ids.shape[1])
        context_mask = (None if attention_mask is None
                        else padding_mask(attention_mask.astype(bool)))
        mask = (None if decoder_attention_mask is None
                else padding_mask(decoder_attention_mask.astype(bool)))
        hidden = self.decoder(self.decoder_embeddings(decoder_input_ids, positions),
                              positions=positions, mask=mask, context=encoded,
                              context_mask=context_mask)
        if self.head is not None:
            return self.head(hidden).astype(jnp.float32)
        if self.config.scale_tied_head:
            hidden = hidden * self.config.d_model**-0.5
        return self.encoder_embeddings.tokens.attend(hidden).astype(jnp.float32)
