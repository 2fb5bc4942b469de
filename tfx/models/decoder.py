"""Causal language model: GPT-2, LLaMA, Mistral and their small relatives."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models import checks
from tfx.models.block import dtypes
from tfx.models.config import DecoderConfig
from tfx.models.leading import leading_inputs
from tfx.models.stack import Embeddings, Stack
from tfx.nn import axes
from tfx.nn.embeddings import TokenEmbedding
from tfx.nn.gated_delta_net import GatedDeltaNet
from tfx.nn.linear import flat_linear, is_plain
from tfx.nn.per_layer_embeddings import PerLayerEmbeddings
from tfx.ops.activations import softcap
from tfx.ops.kv_cache import (
    KVCache,
    SegmentMemory,
    init_cache,
    init_latent_cache,
    init_memory,
)
from tfx.ops.masks import padding_mask
from tfx.ops.paged import PagedCache

__all__ = ["Decoder"]


class Decoder(nnx.Module):
    """Token embeddings -> causal layers -> final norm -> output head (tied or not).

    Call it like Hugging Face's *ForCausalLM: `logits = model(input_ids, attention_mask=mask)`.
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = Embeddings(config, rngs=rngs)
        self.stack = Stack(config, causal=True, rngs=rngs)
        width = config.embeddings.per_layer_width
        self.per_layer_embeddings = None if width is None else PerLayerEmbeddings(
            config.embeddings.per_layer_vocab_size or config.vocab_size, config.num_layers,
            width, config.d_model, eps=config.norm.eps, rngs=rngs, **dtypes(config))
        self.head = (None if config.embeddings.tie else flat_linear(
            config.d_model, config.vocab_size, use_bias=False,
            kernel_metadata=axes.metadata(axes.EMBED, axes.VOCAB), rngs=rngs,
            **dtypes(config)))

    def __call__(self, input_ids: jax.Array, *, attention_mask: jax.Array | None = None,
                 position_ids: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 cache: KVCache | PagedCache | SegmentMemory | None = None):
        """Next-token logits.

        Args:
          input_ids: int [batch, seq] of ids in [0, vocab_size), batch and seq >= 1; with
            position="learned" seq <= max_len. Every array argument is a jax or numpy array or
            a nested list.
          attention_mask: optional [batch, seq], 1/True for real tokens, 0/False for padding.
          position_ids: optional int [batch, seq] (default 0 .. seq - 1); within the learned
            table (< max_len) for position="learned".
          segment_ids: optional int [batch, seq] for packed sequences.
          cache: from `init_cache`: a KVCache (the tokens continue each sequence at its own next
            position; padding, marked by attention_mask, takes no position), or for
            position="xl" a SegmentMemory (the tokens follow the memory; pad on the left).
            A linear KVCache must have room for the tokens (a ring buffer always has). Or a
            `tfx.ops.paged.PagedCache` whose page table has pages for the tokens (rotary,
            learned, sinusoidal or no positions; no sliding window; see `tfx.generation.Engine`).
        Returns:
          float32 [batch, seq, vocab_size]; with a cache, also the updated cache.
        Raises:
          ValueError: for ids, positions or cache room out of range: always on concrete
            arrays, and under jit in checked mode (`tfx.models.checked`); see
            `tfx.models.checks`.
        """
        hidden = self.hidden_states(input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, segment_ids=segment_ids,
                                    cache=cache)
        if cache is None:
            return self.logits(hidden)
        hidden, cache = hidden
        return self.logits(hidden), cache

    def hidden_states(self, input_ids, *, attention_mask=None, position_ids=None,
                      segment_ids=None,
                      cache: KVCache | PagedCache | SegmentMemory | None = None):
        """[batch, seq] -> the final-normalised hidden states [batch, seq, d_model] (and the
        updated cache when one is given). Leading vectors (`embeddings.num_leading`) run before
        the tokens and their positions are dropped (with a cache, `init_cache` ran them)."""
        input_ids, attention_mask = checks.ids_and_mask(
            "input_ids", input_ids, "attention_mask", attention_mask, self.config.vocab_size)
        if cache is not None:
            if position_ids is not None or segment_ids is not None:
                raise ValueError("with a cache, positions come from the cache: position_ids and "
                                 "segment_ids must be None")
            valid = (jnp.ones(input_ids.shape, bool) if attention_mask is None
                     else attention_mask.astype(bool))
            if isinstance(cache, SegmentMemory):  # a memory of the last tokens: no limit
                mask, memory_valid = cache.mask(valid)
                positions = jnp.arange(input_ids.shape[1])  # unused: XL has only distances
                x, hidden = self.stack(self.embeddings(input_ids, positions),
                                       positions=positions, mask=mask, cache=cache.hidden,
                                       token_mask=valid)
                return x, SegmentMemory(hidden=hidden, valid=memory_valid)
            checks.cache_room("input_ids", cache, valid, self.config)
            return self._cached(input_ids, valid, cache)
        skip = self.embeddings.num_leading
        position_ids = checks.positions("position_ids", position_ids, "input_ids", input_ids,
                                        self.config, skip)
        segment_ids = checks.segment_ids("segment_ids", segment_ids, "input_ids", input_ids,
                                         skip)
        positions = jnp.arange(input_ids.shape[1]) if position_ids is None else position_ids
        if skip:
            positions, attention_mask, _ = leading_inputs(
                skip, self.config, input_ids, positions, attention_mask)
        mask = None if attention_mask is None else padding_mask(attention_mask.astype(bool))
        x = self.embeddings(input_ids, positions,
                            leading=self.embeddings.leading(input_ids.shape[0]))
        x = self.stack(x, positions=positions, mask=mask, segment_ids=segment_ids,
                       token_mask=attention_mask,
                       per_layer_inputs=self.per_layer_inputs(input_ids, x))
        return x[:, skip:]

    def _cached(self, input_ids, valid, cache: KVCache, leading: jax.Array | None = None):
        """The KV-cache path: tokens (after `leading` vectors [batch, G, d_model], if given)
        continue each sequence; valid covers them all."""
        step, cache = cache.plan(valid)
        x = self.embeddings(input_ids, jnp.maximum(step.query_positions, 0), leading=leading)
        x, layers = self.stack(x, positions=step.query_positions, cache=cache.layers,
                               cache_step=step, token_mask=valid,
                               per_layer_inputs=self.per_layer_inputs(input_ids, x))
        return x, dataclasses.replace(cache, layers=layers)

    def per_layer_inputs(self, input_ids: jax.Array, embedded: jax.Array) -> jax.Array | None:
        """Every layer's per-layer input [batch, seq, num_layers, embeddings.per_layer_width]
        from ids [batch, seq] and their embeddings [batch, seq, d_model]
        (`tfx.nn.per_layer_embeddings.PerLayerEmbeddings`); None for a model without
        per-layer embeddings."""
        if self.per_layer_embeddings is None:
            return None
        if embedded.shape[1] != input_ids.shape[1]:
            raise ValueError("per-layer embeddings need one id per embedded vector: leading "
                             "vectors (embeddings.num_leading) are not supported with them")
        return self.per_layer_embeddings(input_ids, embedded)

    def init_cache(self, batch: int, max_len: int, dtype=None, *,
                   rewind: int = 0) -> KVCache | SegmentMemory:
        """An empty KV cache for `batch` sequences of up to `max_len` tokens in all (a ring
        buffer of the sliding window when the config has one shorter than max_len); for
        position="xl", a Transformer-XL memory of the last `max_len` tokens. Linear-attention
        layers (Gated DeltaNet) hold a fixed-size `DeltaState` in their place.

        With leading vectors (`embeddings.num_leading`), the cache has room
        for G more and already holds them (run through the layers here, once), so decoding
        steps continue after them.

        Args:
          batch: rows, int >= 1.
          max_len: tokens per row, int >= 1.
          dtype: of the cache (default: the compute dtype, float32 if unset).
          rewind: the most tokens one `KVCache.rewind` may forget (int >= 0, e.g. the draft
            tokens of speculative decoding): linear-attention layers then also keep their
            states before each of their last `rewind` tokens. 0: their states cannot be
            rewound. Attention layers need nothing for it.
        """
        if isinstance(rewind, bool) or not isinstance(rewind, int) or rewind < 0:
            raise ValueError(f"rewind must be an int >= 0 (tokens a rewind may forget), got "
                             f"{rewind!r}")
        c = self.config
        g = self.embeddings.num_leading
        if c.position == "learned" and max_len + g > c.max_len:
            raise ValueError(f"max_len ({max_len}) + {g} leading vectors exceeds the "
                             f"learned position table (config.max_len = {c.max_len})")
        dtype = jnp.dtype(dtype or dtypes(c)["dtype"] or jnp.float32)
        if c.position == "xl":
            if g:
                raise ValueError("leading vectors are not supported with a "
                                 "Transformer-XL memory (position='xl'), which would forget them")
            return init_memory(num_layers=c.num_layers, batch=batch, mem_len=max_len,
                               d_model=c.d_model, dtype=dtype, stacked=c.compute.scan_layers)
        # A ring buffer of the window when every attention layer slides; full layers need
        # every key. Linear layers keep a DeltaState instead (`with_linear_states`).
        # Layers that attend another's keys (attention.shared_kv_layers) cache nothing.
        types = [c.layer_type(i) for i in range(c.num_layers - c.attention.shared_kv_layers)]
        attending = [t for t in types if t != "linear"]
        sliding = all(t == "sliding" for t in attending)
        layout = dict(num_layers=len(attending), batch=batch, max_len=max_len + g,
                      dtype=dtype, window=c.attention.sliding_window if sliding else None,
                      stacked=c.compute.scan_layers)
        if not attending:  # linear layers only: the positions' bookkeeping, no KV layer
            cache = KVCache.no_layers(batch, max_len + g)
        elif c.latent is not None:  # the compressed latent and the rotary key
            cache = init_latent_cache(kv_lora_rank=c.latent.kv_lora_rank,
                                      qk_rope_head_dim=c.latent.qk_rope_head_dim, **layout)
        else:
            cache = _kv_cache(c, attending, layout)
        if len(attending) < c.num_layers:
            cache = self.with_linear_states(cache, batch, dtype, history=rewind)
        if g:
            _, cache = self._cached(jnp.zeros((batch, 0), jnp.int32), jnp.ones((batch, g), bool),
                                    cache, leading=self.embeddings.leading(batch))
        return cache

    def with_linear_states(self, cache: KVCache | PagedCache, batch: int, dtype, *,
                           history: int = 0) -> KVCache | PagedCache:
        """`cache` (a tuple of KV layers or page pools for the attention layers, in order,
        at least one) with an empty `DeltaState` [batch, ...] at each linear layer's place:
        one state per layer and row, whatever the sequence length; `history` as
        `GatedDeltaNet.empty_state`'s. Layers that attend an earlier layer's keys
        (attention.shared_kv_layers) get None: they cache nothing."""
        kv_layers = iter(cache.layers)
        layers = tuple(
            block.attention.empty_state(batch, dtype, history=history)
            if isinstance(block.attention, GatedDeltaNet)
            else None if source is not None else next(kv_layers)  # shared keys: no cache
            for block, source in zip(self.stack.layers, self.stack.kv_sources, strict=True))
        return dataclasses.replace(cache, layers=layers)

    def logits(self, hidden: jax.Array, output_weights: jax.Array | None = None) -> jax.Array:
        """[batch, seq, d_model] -> float32 [batch, seq, vocab_size], soft-capped by
        config.logit_softcap when it has one.

        output_weights: `self.output_weights()` computed once by a caller that applies the head
        many times (a decoding loop); None uses the head directly.
        """
        if output_weights is not None:
            out = hidden @ output_weights.astype(hidden.dtype)
        else:
            out = (self.embeddings.tokens.attend(hidden) if self.head is None
                   else self.head(hidden))
        out, cap = out.astype(jnp.float32), self.config.logit_softcap
        return out if cap is None else softcap(out, cap)

    def output_weights(self) -> jax.Array | None:
        """The output head as one [d_model, vocab_size] matrix: the head's kernel, or the
        embedding table transposed when tied. A decoding loop takes it once: on CPU, the tied
        product with the [vocab_size, d_model] table re-lays the table out at every step.
        None when the head is not a plain matrix (a fine-tuning transform wrapped the head or
        the table): the caller then applies the head itself (`logits(hidden)`)."""
        if self.head is None:
            tokens = self.embeddings.tokens
            return tokens.table[...].T if type(tokens) is TokenEmbedding else None
        return self.head.kernel[...] if is_plain(self.head) else None


def _kv_cache(config: DecoderConfig, types: list[str], layout: dict) -> KVCache:
    """An empty KV cache for attention layers of `types` (in order), each with its own heads
    and head width (`DecoderConfig.layer_heads`: Gemma 4's "full" layers are wider)."""
    shapes = [config.layer_heads(kind) for kind in types]
    if len(set(shapes)) == 1:  # one shape: one call
        kv_heads, head_dim = shapes[0]
        return init_cache(num_kv_heads=kv_heads, head_dim=head_dim, **layout)
    built = {shape: init_cache(num_kv_heads=shape[0], head_dim=shape[1],
                               **{**layout, "num_layers": shapes.count(shape)})
             for shape in set(shapes)}
    layers = {shape: iter(cache.layers) for shape, cache in built.items()}
    # The slot bookkeeping (positions, next_position) is alike in every one of them.
    return dataclasses.replace(next(iter(built.values())),
                               layers=tuple(next(layers[shape]) for shape in shapes))
