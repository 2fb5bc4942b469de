"""Encoder–decoder: T5 and the original Transformer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models import checks
from tfx.models.block import dtypes
from tfx.models.config import EncoderDecoderConfig
from tfx.models.leading import leading_inputs, prepend
from tfx.models.stack import Embeddings, Stack
from tfx.nn import axes
from tfx.nn.embeddings import TokenEmbedding
from tfx.nn.linear import flat_linear
from tfx.ops.kv_cache import Seq2SeqCache, init_cache
from tfx.ops.masks import padding_mask

__all__ = ["EncoderDecoder"]


class EncoderDecoder(nnx.Module):
    """Shared token embedding; a bidirectional encoder; a causal decoder whose every layer also
    attends to the encoder output; output head tied (scaled by d_model**-0.5 for T5) or not.

    Call it like Hugging Face's T5ForConditionalGeneration:
    `logits = model(input_ids, attention_mask=mask, decoder_input_ids=ids)`.

    input_ids and decoder_input_ids are int [batch, seq] ids in [0, vocab_size), batch and
    seq >= 1 (seq <= max_len for position="learned"), and their masks of the same shape: jax or
    numpy arrays or nested lists; a decoding cache must have room for the tokens fed.
    Values out of range raise ValueError (see `tfx.models.checks`, also for checked mode).
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
        self.head = (None if c.embeddings.tie else
                     flat_linear(c.d_model, c.vocab_size, use_bias=False,
                                 kernel_metadata=axes.metadata(axes.EMBED, axes.VOCAB),
                                 rngs=rngs, **kinds))

    def __call__(self, input_ids: jax.Array, *, decoder_input_ids: jax.Array,
                 attention_mask: jax.Array | None = None,
                 decoder_attention_mask: jax.Array | None = None,
                 position_ids: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 decoder_position_ids: jax.Array | None = None,
                 decoder_segment_ids: jax.Array | None = None) -> jax.Array:
        """Decoder logits, float32 [batch, target_len, vocab_size] (teacher forcing).

        Packed rows (several examples side by side) give each example's positions and segment
        ids, int [batch, src_len] (`position_ids`, `segment_ids`) and [batch, target_len]
        (`decoder_position_ids`, `decoder_segment_ids`): example k of a row is source segment
        k and target segment k, and each attends only within its own example.
        """
        encoded = self.encode(input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, segment_ids=segment_ids)
        return self.decode(decoder_input_ids, encoded, attention_mask=attention_mask,
                           decoder_attention_mask=decoder_attention_mask,
                           position_ids=decoder_position_ids, segment_ids=decoder_segment_ids,
                           encoder_segment_ids=segment_ids)

    def encode(self, input_ids: jax.Array, *, attention_mask: jax.Array | None = None,
               position_ids: jax.Array | None = None, segment_ids: jax.Array | None = None):
        """int [batch, src_len] -> encoder output [batch, src_len, d_model].

        position_ids, segment_ids: optional int [batch, src_len] of packed sources (as in
        `tfx.models.Encoder`).

        With G leading vectors (`encoder_embeddings.num_leading`) the output keeps them in
        front, [batch, G + src_len, d_model], so that the decoder attends to them too;
        `decode` and `init_cache` still take the [batch, src_len] attention_mask of the tokens.
        """
        input_ids, attention_mask = checks.ids_and_mask(
            "input_ids", input_ids, "attention_mask", attention_mask, self.config.vocab_size)
        positions, segment_ids = self._packing("", input_ids, position_ids, segment_ids,
                                               self.encoder_embeddings.num_leading)
        if self.encoder_embeddings.num_leading:
            positions, attention_mask, _ = leading_inputs(
                self.encoder_embeddings.num_leading, self.config, input_ids, positions,
                attention_mask)
        mask = None if attention_mask is None else padding_mask(attention_mask.astype(bool))
        leading = self.encoder_embeddings.leading(input_ids.shape[0])
        return self.encoder(self.encoder_embeddings(input_ids, positions, leading=leading),
                            positions=positions, mask=mask, segment_ids=segment_ids,
                            token_mask=attention_mask)

    def decode(self, decoder_input_ids: jax.Array, encoded: jax.Array | None = None, *,
               attention_mask: jax.Array | None = None,
               decoder_attention_mask: jax.Array | None = None,
               position_ids: jax.Array | None = None, segment_ids: jax.Array | None = None,
               encoder_segment_ids: jax.Array | None = None,
               cache: Seq2SeqCache | None = None):
        """Decoder tokens and encoder output -> float32 logits [batch, target_len, vocab].

        position_ids, segment_ids: optional int [batch, target_len] of packed targets, and
        encoder_segment_ids int [batch, src_len] those of the packed sources: a target token of
        segment k then attends only to source tokens of segment k.

        With a cache (from `init_cache`) the encoder output, its mask and the cross-attention
        keys/values come from the cache, the tokens continue each sequence, and the updated
        cache is returned as well.
        """
        decoder_input_ids, mask = checks.ids_and_mask(
            "decoder_input_ids", decoder_input_ids, "decoder_attention_mask",
            decoder_attention_mask, self.config.vocab_size)
        mask = None if mask is None else mask.astype(bool)
        if cache is None:
            if encoded is None:
                raise ValueError("decode needs the encoder output `encoded` or a `cache`")
            positions, segment_ids = self._packing("decoder_", decoder_input_ids, position_ids,
                                                   segment_ids)
            hidden = self.decoder(self.decoder_embeddings(decoder_input_ids, positions),
                                  positions=positions,
                                  mask=None if mask is None else padding_mask(mask),
                                  segment_ids=segment_ids, context=encoded,
                                  context_mask=self._context_mask(attention_mask),
                                  context_segment_ids=encoder_segment_ids, token_mask=mask)
            return self._logits(hidden)
        if any(x is not None for x in (position_ids, segment_ids, encoder_segment_ids)):
            raise ValueError("with a cache, positions come from the cache: position_ids, "
                             "segment_ids and encoder_segment_ids must be None")
        if encoded is not None or attention_mask is not None:
            raise ValueError("with a cache, the encoder output and its mask come from the cache: "
                             "encoded and attention_mask must be None")
        valid = jnp.ones(decoder_input_ids.shape, bool) if mask is None else mask
        checks.cache_room("decoder_input_ids", cache.decoder, valid, self.config)
        step, decoder_cache = cache.decoder.plan(valid)
        x = self.decoder_embeddings(decoder_input_ids, jnp.maximum(step.query_positions, 0))
        hidden, layers = self.decoder(x, positions=step.query_positions, context=cache.cross,
                                      context_mask=cache.context_mask,
                                      cache=decoder_cache.layers, cache_step=step,
                                      token_mask=valid)
        decoder_cache = dataclasses.replace(decoder_cache, layers=layers)
        return self._logits(hidden), dataclasses.replace(cache, decoder=decoder_cache)

    def init_cache(self, encoded: jax.Array, max_len: int, dtype=None, *,
                   attention_mask: jax.Array | None = None) -> Seq2SeqCache:
        """Decoding state for an encoder output [batch, src_len, d_model]: an empty
        self-attention cache for up to `max_len` decoder tokens, and every layer's cross-attention
        keys and values computed here, once.

        attention_mask: [batch, src_len] of the source (1 = real token), or None.
        dtype: of the self-attention cache (default: the compute dtype, float32 if unset).
        """
        c = self.config
        if encoded.ndim != 3 or encoded.shape[-1] != c.d_model:
            raise ValueError(f"encoded must be [batch, src_len, {c.d_model}], got "
                             f"{tuple(encoded.shape)}")
        if c.position == "learned" and max_len > c.max_len:
            raise ValueError(f"max_len ({max_len}) exceeds the learned position table "
                             f"(config.max_len = {c.max_len})")
        decoder = init_cache(num_layers=c.decoder_layers, batch=encoded.shape[0], max_len=max_len,
                             num_kv_heads=c.kv_heads,
                             head_dim=c.attention.head_dim or c.d_model // c.num_heads,
                             dtype=jnp.dtype(dtype or dtypes(c)["dtype"] or jnp.float32),
                             stacked=c.compute.scan_layers)
        return Seq2SeqCache(decoder=decoder, cross=self.decoder.cross_keys_values(encoded),
                            context_mask=self._context_mask(attention_mask))

    def _packing(self, side: str, ids: jax.Array, position_ids, segment_ids,
                 leading: int = 0) -> tuple[jax.Array, jax.Array | None]:
        """A stack's (positions, segment ids), checked: the given position ids (within a
        learned table) or 0 .. seq - 1, and the segment ids (None: one sequence per row)."""
        position_ids = checks.positions(f"{side}position_ids", position_ids,
                                        f"{side}input_ids", ids, self.config, leading)
        segment_ids = checks.segment_ids(f"{side}segment_ids", segment_ids,
                                         f"{side}input_ids", ids, leading)
        return (jnp.arange(ids.shape[1]) if position_ids is None else position_ids), segment_ids

    def _context_mask(self, attention_mask: jax.Array | None) -> jax.Array | None:
        """The source mask [batch, src_len] -> the cross-attention key mask over the encoder
        output (with True for the encoder's leading vectors in front)."""
        if attention_mask is None:
            return None
        attention_mask = prepend(checks.as_array("attention_mask", attention_mask).astype(bool),
                                 self.encoder_embeddings.num_leading, True)
        return padding_mask(attention_mask)

    def _logits(self, hidden: jax.Array) -> jax.Array:
        if self.head is not None:
            return self.head(hidden).astype(jnp.float32)
        if self.config.scale_tied_head:
            hidden = hidden * self.config.d_model**-0.5
        return self.encoder_embeddings.tokens.attend(hidden).astype(jnp.float32)
