"""What every family shares: the input embeddings and a stack of layers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models.block import Block, RematBlock, dtypes, model_norm
from tfx.models.config import EncoderConfig, TransformerConfig
from tfx.nn import axes
from tfx.nn.attention import NoCache, Recorded, RecordKeys, SharedKeys
from tfx.nn.caches import SegmentLayer, kv_cache_layer
from tfx.nn.dropout import make_dropout
from tfx.nn.embeddings import LearnedPositions, SinusoidalPositions, TokenEmbedding
from tfx.nn.relative_bias import RelativePositionBias
from tfx.ops.attention.context_parallel import SEQUENCE_AXIS, split_sequence
from tfx.ops.kv_cache import CacheStep, LayerKV
from tfx.ops.masks import combine_masks
from tfx.ops.sparse import SlidingWindow, parse_spec

__all__ = ["Embeddings", "Stack"]


class Embeddings(nnx.Module):
    """Token embedding, plus absolute positions and token types where the config has them.

    Token embeddings are multiplied by sqrt(d_model) with `embeddings.scale` (Vaswani et al.).
    Post-norm models (BERT) normalise the sum, as BERT does, and so do pre-norm ones with
    `embeddings.norm` (ModernBERT); dropout follows. Encoders with `type_vocab_size` 0 have no
    token types.
    """

    def __init__(self, config: TransformerConfig, *, tokens: TokenEmbedding | None = None,
                 rngs: nnx.Rngs):
        c, kinds = config, dtypes(config)
        self.tokens = tokens or TokenEmbedding(c.vocab_size, c.d_model, rngs=rngs, **kinds)
        self.token_scale = c.d_model ** 0.5 if c.embeddings.scale else None
        positions = None
        if c.position == "learned":
            positions = LearnedPositions(c.max_len, c.d_model, rngs=rngs, **kinds)
        elif c.position == "sinusoidal":
            positions = SinusoidalPositions(c.d_model, dtype=kinds["dtype"])
        self.positions = positions
        # Two rows (BERT's segments): too few to split over the vocabulary's mesh axes.
        self.token_types = (TokenEmbedding(c.type_vocab_size, c.d_model, vocab_axis=None,
                                           rngs=rngs, **kinds)
                            if isinstance(c, EncoderConfig) and c.type_vocab_size else None)
        normalised = c.embeddings.norm or not c.norm.pre_norm
        self.norm = model_norm(c, rngs=rngs) if normalised else None
        self.dropout = make_dropout(c.dropout, rngs=rngs)

    num_leading = 0  # vectors put before the tokens at every call (see `leading`)

    def leading(self, batch: int) -> jax.Array | None:
        """The `num_leading` vectors [batch, G, d_model] that models put before the tokens of
        a sequence (`tfx.models.leading`), or None: none here; a subclass may add some."""
        return None

    def __call__(self, input_ids: jax.Array, positions: jax.Array,
                 token_type_ids: jax.Array | None = None, *,
                 leading: jax.Array | None = None) -> jax.Array:
        """int [batch, seq] -> [batch, seq, d_model].

        leading: vectors [batch, G, d_model] put before the token embeddings (`self.leading`),
          so that they get positions, token types and the norm like tokens (`positions` and
          `token_type_ids` then cover G + seq); the output is [batch, G + seq, d_model].
        """
        x = self.tokens(input_ids)
        if self.token_scale is not None:
            x = x * jnp.asarray(self.token_scale, x.dtype)
        if leading is not None:
            x = jnp.concatenate([leading.astype(x.dtype), x], axis=1)
        if self.positions is not None:
            x = x + self.positions(positions)
        if self.token_types is not None:
            types = (jnp.zeros(x.shape[:2], jnp.int32) if token_type_ids is None
                     else token_type_ids)
            x = x + self.token_types(types)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def _layer_apart(make, rngs: nnx.Rngs) -> nnx.Module:
    """`make(rngs=rngs)`; when `rngs` is traced (`nnx.eval_shape`, `init_sharded`), traced in
    a nested jit of its own, which XLA inlines: the same ops on the same keys, the same values.

    Why: each draw from a traced `nnx.Rngs` sets its count Variable, and flax (0.12)'s
    `Variable.set_value` reads the new count's `.sharding`; on a tracer that raises an
    AttributeError whose message jax builds by scanning every equation traced so far in the
    frame. Building a big model in one frame costs draws x equations; a frame per layer keeps
    each scan to one layer's equations (`nnx.eval_shape` of qwen3-next-80b-a3b: 15.3 s -> 2.0 s
    on a quiet 2-core CPU).
    """
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(nnx.state(rngs))):
        return make(rngs=rngs)
    return nnx.jit(lambda rngs: make(rngs=rngs))(rngs)


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
        self.causal = causal
        layer = RematBlock if c.compute.remat else Block
        count = c.num_layers if num_layers is None else num_layers
        # Each layer's window (None: full attention), c.layer_type's "sliding" layers.
        self.windows = tuple(c.attention.sliding_window if c.layer_type(i) == "sliding"
                             else None for i in range(count))
        # Per layer, the earlier layer whose keys and values it attends (None: its own).
        self.kv_sources = kv_sources(c, count)
        pattern = c.attention.pattern
        self.attention_pattern = None if pattern is None else parse_spec(pattern)
        self.relative_bias = (RelativePositionBias(
            c.num_heads, bidirectional=not causal, num_buckets=c.t5.num_buckets,
            max_distance=c.t5.max_distance, param_dtype=kinds["param_dtype"], rngs=rngs)
            if c.position == "t5" else None)
        self.scan_layers = c.compute.scan_layers
        if c.compute.scan_layers:
            # One Block whose weights carry a leading [num_layers] axis, compiled once.
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: axes.LAYERS})
            def stacked(rngs):
                return layer(c, cross_attention=cross_attention, moe=c.is_moe_layer(0),
                             layer_type=c.layer_type(0), positional=c.has_positions(0),
                             attention_norm=c.norm.first_attention, rngs=rngs)

            self.layers = stacked(rngs)
        else:
            self.layers = nnx.List([_layer_apart(functools.partial(
                layer, c, cross_attention=cross_attention, moe=c.is_moe_layer(i),
                layer_type=c.layer_type(i), positional=c.has_positions(i),
                attention_norm=c.norm.first_attention or i > 0,
                shares_keys=self.kv_sources[i] is not None), rngs)
            for i in range(count)])
        self.final_norm = model_norm(c, rngs=rngs) if c.norm.pre_norm else None
        self.dropout = make_dropout(c.dropout, rngs=rngs)

    def __call__(self, x: jax.Array, *, positions: jax.Array, mask: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 context: jax.Array | LayerKV | tuple[LayerKV, ...] | None = None,
                 context_mask: jax.Array | None = None,
                 context_segment_ids: jax.Array | None = None,
                 cache: LayerKV | tuple | jax.Array | None = None,
                 cache_step: CacheStep | None = None, token_mask: jax.Array | None = None,
                 per_layer_inputs: jax.Array | None = None):
        """[batch, seq, d_model] -> [batch, seq, d_model] (and the updated layer caches).

        Args:
          positions: int [batch, seq] or [seq], true token positions (RoPE, ALiBi, T5 bias);
            ignored with a cache, whose step supplies them.
          mask: bool key mask broadcastable to [batch, heads, seq, seq] (padding), combined with
            the causal mask and the sliding window or attention pattern of the config.
          segment_ids: int [batch, seq] for packed sequences.
          context: encoder output (or per-layer cross keys/values from `cross_keys_values`)
            for cross-attention.
          context_mask: the mask of `context` for cross-attention.
          context_segment_ids: int [batch, src_len], the segments of a packed `context`
            (cross-attention then keeps each of `segment_ids` to its own).
          cache: per-layer self-attention caches (`KVCache.layers`), with `cache_step`;
            visibility then comes from the cache's positions. Or per-layer Transformer-XL
            memories (`SegmentMemory.hidden`) alone, with `mask` from `SegmentMemory.mask`.
          cache_step: the call's `CacheStep` with a KV cache, or `PagedStep` with a paged one
            (`tfx.ops.paged`).
          token_mask: bool [batch, seq], False for padding tokens, which mixture-of-experts
            layers then route nowhere.
          per_layer_inputs: [batch, seq, num_layers, embeddings.per_layer_width], every
            layer's per-layer input (`tfx.nn.per_layer_embeddings.PerLayerEmbeddings`), for a
            config with them.
        Returns:
          hidden states, or (hidden states, updated cache layers) when a cache is given.
        """
        if cache is not None and self.attention_pattern is not None:
            raise ValueError("a model with an attention_pattern cannot decode with a KV cache or "
                             "Transformer-XL memory, which hold no sparse pattern: call it on "
                             "whole sequences (generation needs a dense or sliding-window model)")
        if SEQUENCE_AXIS in jax.sharding.get_abstract_mesh().axis_names:
            x = split_sequence(x)  # context parallelism keeps the sequence split
        key_positions = positions
        if cache_step is not None:
            positions, key_positions = cache_step.query_positions, cache_step.key_positions
        bias = None
        if self.relative_bias is not None:
            bias = self.relative_bias(positions, key_positions)
        shared = dict(bias=bias, positions=positions, query_segment_ids=segment_ids,
                      context_mask=context_mask, context_segment_ids=context_segment_ids)
        visibility = {window: self._visibility(mask, window, cache is not None, cache_step,
                                               positions)
                      for window in set(self.windows)}
        per_layer_context = isinstance(context, LayerKV | tuple)
        kind = SegmentLayer if cache_step is None else (lambda kv: kv_cache_layer(kv, cache_step))
        if self.scan_layers:
            args = shared | visibility[self.windows[0]]  # scanned layers are all alike

            def run(h, block, layer_cache, layer_context):  # one layer: the scan's body
                out = block(h, context=layer_context, token_mask=token_mask,
                            cache=None if layer_cache is None else kind(layer_cache), **args)
                return out if layer_cache is not None else (out, None)

            axes = (nnx.Carry, 0, None if cache is None else 0, 0 if per_layer_context else None)
            with jax.named_scope("layers"):  # the scan's body is every layer: no index
                x, cache = nnx.scan(run, in_axes=axes, out_axes=(nnx.Carry, 0))(
                    x, self.layers, cache, context)
        else:
            contexts = context if per_layer_context else [context] * len(self.layers)
            x, cache = self._each_layer(x, cache, kind, contexts, per_layer_inputs,
                                        token_mask=token_mask, **shared,
                                        visibility=visibility)
        if self.final_norm is not None:
            x = self.dropout(self.final_norm(x))
        return x if cache is None else (x, cache)

    def _each_layer(self, x, cache, kind, contexts, per_layer_inputs, *, visibility, **shared):
        """Run the layers one after the other (not scanned): x and the updated caches (None
        without a cache). A layer whose keys later layers share returns them with its cache
        (`RecordKeys`, `Recorded`); those layers attend them (`SharedKeys`) and keep no cache
        (their entry stays None)."""
        caches = [None] * len(self.layers) if cache is None else cache
        recorded, owners, updated = {}, set(self.kv_sources) - {None}, []
        for i, (layer, layer_cache, layer_context, window) in enumerate(zip(
                self.layers, caches, contexts, self.windows, strict=True)):
            kv = None if layer_cache is None else kind(layer_cache)
            if self.kv_sources[i] is not None:
                kv = SharedKeys(recorded[self.kv_sources[i]])
            elif i in owners:
                kv = RecordKeys(NoCache() if kv is None else kv)
            extra = {} if per_layer_inputs is None else {
                "per_layer_input": per_layer_inputs[:, :, i]}
            with jax.named_scope(f"layer_{i}"):  # profiles read by layer
                x = layer(x, context=layer_context, cache=kv, **extra, **shared,
                          **visibility[window])
            if isinstance(x, tuple):
                x, layer_cache = x
            if isinstance(layer_cache, Recorded):
                recorded[i], layer_cache = layer_cache.keys, layer_cache.state
            updated.append(layer_cache)
        return x, None if cache is None else tuple(updated)

    def _visibility(self, mask: jax.Array | None, window: int | None, cached: bool,
                    cache_step: CacheStep | None, positions: jax.Array) -> dict:
        """The mask, sparsity and is_causal of a self-attention whose layer sees the last
        `window` tokens (None: all); a bidirectional layer sees those less than `window`
        `positions` away on either side. With a cache, its own mask says the rest (a KV cache's
        positions; a Transformer-XL memory's mask over [memory | segment]); a window narrower
        than what the KV cache keeps (a model mixing sliding and full layers) is added to it."""
        if cached:
            if window is not None and cache_step is not None:
                q = cache_step.query_positions[:, None, :, None]
                mask = combine_masks(mask, q - cache_step.key_positions[:, None, None, :]
                                     < window)
            return dict(mask=mask, sparsity=None, is_causal=False)
        if not self.causal:
            if window is not None:
                mask = combine_masks(mask, _within(positions, window))
            return dict(mask=mask, sparsity=None, is_causal=False)
        if window is not None:  # a sliding window is itself causal (Mistral)
            return dict(mask=mask, sparsity=SlidingWindow(window), is_causal=False)
        # None, or a pattern intersected with the causal mask
        return dict(mask=mask, sparsity=self.attention_pattern, is_causal=True)

    def cross_keys_values(self, context: jax.Array) -> LayerKV | tuple[LayerKV, ...]:
        """Every layer's cross-attention keys and values of an encoder output
        [batch, src_len, d_model], computed once for decoding (stacked when layers are)."""
        def project(block):
            return block.cross_attention.keys_values(context)

        if self.scan_layers:
            return nnx.vmap(project, in_axes=0, out_axes=0)(self.layers)
        return tuple(project(block) for block in self.layers)


def kv_sources(config: TransformerConfig, count: int) -> tuple[int | None, ...]:
    """Per layer, the index of the layer whose keys and values it attends: None for its own;
    for the last attention.shared_kv_layers layers, the last layer of the same type before
    them (transformers' Gemma 4 `kv_sharing_modes`)."""
    first = count - config.attention.shared_kv_layers
    owner = {config.layer_type(i): i for i in range(first)}  # the last of each type wins
    return tuple(None if i < first else owner[config.layer_type(i)] for i in range(count))


def _within(positions: jax.Array, window: int) -> jax.Array:
    """bool [batch or 1, 1, seq, seq]: whether key k is less than `window` positions from query
    q on either side (an encoder's sliding window, ModernBERT's local attention). Positions, not
    indices, so that packed documents (positions restarting at 0) keep their windows.

    Args:
      positions: int [batch, seq] or [seq].
    """
    positions = jnp.atleast_2d(positions)
    return jnp.abs(positions[:, None, :, None] - positions[:, None, None, :]) < window
