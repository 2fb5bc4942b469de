"""Multi-head attention (MHA / GQA / MQA, self or cross) as a Flax NNX module, and the `Keys`
it attends.

A call reads top to bottom: project queries (and the call's keys and values), encode positions
(`tfx.nn.positions`), take what the cache adds (`NoCache` here for plain self- and
cross-attention; the KV caches in `tfx.nn.caches`), run the kernel on the `Keys`
(`tfx.ops.dot_product_attention`), project the output.

A cache kind answers three questions, in this order:
1. `sources(x, context)`: the input the call's new keys and values are projected from (None:
   the call brings no new keys, all come from the cache);
2. `query_positions(positions, q_len)`: the true positions of the call's queries;
3. `attend(keys, x) -> (keys, state)`: given the call's own `Keys` (projected, rotated), the
   `Keys` every query attends and the layer's next cache state (None: nothing to return).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tfx.nn import axes
from tfx.nn.linear import flat_linear
from tfx.nn.norms import QKNorm
from tfx.nn.positions import Position
from tfx.nn.remat import KEY_PROJ, QUERY_PROJ, VALUE_PROJ
from tfx.ops._pytree import static_field
from tfx.ops.attention import IMPLEMENTATIONS, dot_product_attention
from tfx.ops.kv_cache import LayerKV
from tfx.ops.norms import rms_norm
from tfx.ops.sparse import SparsitySpec

__all__ = ["Attention", "CrossKV", "Keys", "NoCache", "RecordKeys", "Recorded", "SharedKeys",
           "cache_for"]


class Attention(nnx.Module):
    """Projections to queries, keys and values, `tfx.ops.dot_product_attention`, output projection.

    The kernel is chosen by configuration (`implementation`, `block_sizes`), so every model built
    on this module runs on the reference or the blocked (flash-style) path without code changes.

    Args:
      d_model: width of the input (and of the output).
      num_heads: query heads.
      num_kv_heads: key/value heads, dividing num_heads (default num_heads: MHA; 1: MQA).
      head_dim: features per head (default d_model // num_heads).
      kv_features: width of the cross-attention context (default d_model).
      use_bias: biases on the four projections (BERT, GPT-2: True; LLaMA, T5: False).
      qkv_bias: biases on the query, key and value projections only (default use_bias; Qwen 2:
        True with use_bias False).
      out_bias: a bias on the output projection (default use_bias; Qwen 3: True with
        use_bias False, its MLP having none).
      qk_norm: RMS-normalise queries and keys before positions are applied: "per_head" (each
        head's head_dim features: Qwen 3, Gemma 3), "across_heads" (all heads' features at
        once: OLMo 2) or None.
      norm_eps: epsilon of those norms.
      scale: score multiplier (default 1/sqrt(head_dim); T5 uses 1.0).
      softcap: scores become softcap · tanh(scores / softcap) (Gemma 2), or None.
      sinks: a learned sink logit per query head (GPT-OSS), `sinks` [num_heads] (zeros at
        init), counted in every softmax as a key of value zero (`tfx.ops.dot_product_attention`'s
        sinks).
      output_gate: gate each head's output elementwise by sigmoid of a projection of the input,
        before the output projection (Qwen3-Next, Qwen3.5): `gate`, [d_model] ->
        [num_heads · head_dim], with the query's bias setting.
      value_norm: RMS-normalise each head's values over head_dim, without a scale (Gemma 4).
      values_are_keys: no value projection: the values are the key projection's output,
        before the key norm and rotation (Gemma 4's attention_k_eq_v).
      projects_keys: False for a layer that attends another layer's keys and values
        (`SharedKeys`: Gemma 4's KV sharing), which then has no key and value projections.
      position: how this attention encodes positions, a `tfx.nn.positions.Position` (Rotary,
        ALiBi, TransformerXL, ...); None: none (NoPE).
      implementation: an implementation of `tfx.ops.dot_product_attention` ("reference",
        "blocked", "cudnn", "pallas_gpu", "splash") or None (the platform's best, as in the op).
      block_sizes: (block_q, block_k) for the blocked path, or None for the default.
      dtype: compute dtype (e.g. jnp.bfloat16); param_dtype: storage dtype of the weights.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, kv_features: int | None = None,
                 use_bias: bool = False, qkv_bias: bool | None = None,
                 out_bias: bool | None = None,
                 qk_norm: str | None = None, norm_eps: float = 1e-6,
                 scale: float | None = None, softcap: float | None = None,
                 sinks: bool = False, output_gate: bool = False, value_norm: bool = False,
                 values_are_keys: bool = False, projects_keys: bool = True,
                 position: Position | None = None, implementation: str | None = None,
                 block_sizes: tuple[int, int] | None = None, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must be >= 1 and divide num_heads ({num_heads})")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(
                    f"d_model ({d_model}) must be divisible by num_heads ({num_heads}) "
                    "unless head_dim is given")
            head_dim = d_model // num_heads
        if implementation not in (None, *IMPLEMENTATIONS):
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
        self.d_model, self.num_heads = d_model, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.scale, self.softcap = scale, softcap
        self.value_norm_eps = norm_eps if value_norm else None
        self.implementation, self.block_sizes = implementation, block_sizes
        self.position = Position() if position is None else position
        kv_features = d_model if kv_features is None else kv_features
        qkv_bias = use_bias if qkv_bias is None else qkv_bias

        def linear(features_in, features_out, axes_in, axes_out, bias_axes, bias=qkv_bias):
            return flat_linear(features_in, features_out, use_bias=bias, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs,
                               kernel_metadata=axes.metadata(axes_in, axes_out),
                               bias_metadata=axes.metadata(bias_axes) if bias_axes else {})

        self.query = linear(d_model, num_heads * head_dim, axes.EMBED, axes.HEADS, axes.HEADS)
        self.gate = (linear(d_model, num_heads * head_dim, axes.EMBED, axes.HEADS, axes.HEADS)
                     if output_gate else None)
        self.key, self.value = (
            (linear(kv_features, num_kv_heads * head_dim, axes.EMBED, axes.HEADS, axes.HEADS),
             None if values_are_keys else
             linear(kv_features, num_kv_heads * head_dim, axes.EMBED, axes.HEADS, axes.HEADS))
            if projects_keys else (None, None))
        self.out = linear(num_heads * head_dim, d_model, axes.HEADS, axes.EMBED, None,
                          use_bias if out_bias is None else out_bias)
        self.query_norm, self.key_norm = (
            (None, None) if qk_norm is None else
            (QKNorm(qk_norm, num_heads, head_dim, norm_eps, dtype, param_dtype, rngs),
             QKNorm(qk_norm, num_kv_heads, head_dim, norm_eps, dtype, param_dtype, rngs)
             if projects_keys else None))
        # Small and read by every head's softmax: replicated (no axis names).
        self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype)) if sinks else None

    def __call__(self, x: jax.Array, context: jax.Array | LayerKV | None = None, *,
                 positions: jax.Array | None = None, key_positions: jax.Array | None = None,
                 cache: NoCache | None = None, mask: jax.Array | None = None,
                 bias: jax.Array | None = None, is_causal: bool = False,
                 sparsity: SparsitySpec | None = None,
                 query_segment_ids: jax.Array | None = None,
                 key_segment_ids: jax.Array | None = None):
        """Attend from `x` to `context` (or to `x` itself).

        Args:
          x: [batch, q_len, d_model].
          context: [batch, kv_len, kv_features] for cross-attention, or its keys and values
            already projected (`keys_values`, computed once per encoder output); None for
            self-attention.
          positions: int [batch, q_len] or [q_len], true positions of the queries (default
            0 .. q_len - 1); key_positions likewise for the keys (default: the query positions
            in self-attention, 0 .. kv_len - 1 in cross-attention).
          cache: a cache kind (one of `tfx.nn.caches`: a KV cache layer with its step, which
            then supplies positions and the mask, or a Transformer-XL memory), or None.
          mask: bool, broadcastable to [batch, heads, q_len, kv_len], as in
            `tfx.ops.dot_product_attention`.
          bias: as in `tfx.ops.dot_product_attention`.
          is_causal: as in `tfx.ops.dot_product_attention`.
          sparsity: as in `tfx.ops.dot_product_attention`.
          query_segment_ids: as in `tfx.ops.dot_product_attention`.
          key_segment_ids: as in `tfx.ops.dot_product_attention`.
        Returns:
          [batch, q_len, d_model]; with a cache, also the layer's next cache state (LayerKV,
          or the memory shifted by q_len, without gradient).
        """
        if x.ndim != 3:
            raise ValueError(f"x must have 3 dims [batch, q_len, d_model], got shape {x.shape}")
        source = cache_for(cache, context)
        query = checkpoint_name(self.query(x), QUERY_PROJ)  # what a remat policy may keep
        query = self._heads(query, self.num_heads, self.query_norm)
        inputs = source.sources(x, context)
        key, value = (None, None) if inputs is None else self._project(inputs)
        positions = source.query_positions(positions, x.shape[1])
        if key_positions is None and inputs is not None:
            key_positions = positions if context is None else jnp.arange(inputs.shape[1])
        query, key = self.position.encode(query, key, positions, key_positions)
        keys, cache = source.attend(Keys(
            key, value, key_positions, mask, bias, is_causal, sparsity, query_segment_ids,
            key_segment_ids), x)
        query, position_bias = self.position.bias(query, positions, keys.positions, keys.kv_len)
        keys = self.attended(keys.with_bias(position_bias))
        out = keys.attention(query, scale=self.scale, softcap=self.softcap,
                             implementation=self.implementation, block_sizes=self.block_sizes,
                             sinks=None if self.sinks is None else self.sinks[...])
        out = out.reshape(*x.shape[:2], self.num_heads * self.head_dim)
        if self.gate is not None:  # heads' features in the same order as the gate's
            out = out * jax.nn.sigmoid(self.gate(x)).astype(out.dtype)
        out = self.out(out)
        return out if cache is None else (out, cache)

    def attended(self, keys: Keys) -> Keys:
        """The keys every query attends, as the cache gives them (with the position bias
        added). A subclass may add more, e.g. learned keys and values put before them."""
        return keys

    def keys_values(self, context: jax.Array) -> LayerKV:
        """[batch, kv_len, kv_features] -> keys and values [batch, num_kv_heads, kv_len,
        head_dim] (heads-major, as caches hold them), to cache a cross-attention's once per
        encoder output."""
        return LayerKV(*(jnp.swapaxes(x, 1, 2) for x in self._project(context)))

    def _project(self, source: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[batch, kv_len, features] -> keys and values [batch, kv_len, num_kv_heads, head_dim]."""
        key = checkpoint_name(self.key(source), KEY_PROJ)
        value = key if self.value is None else checkpoint_name(self.value(source), VALUE_PROJ)
        value = self._heads(value, self.num_kv_heads)
        if self.value_norm_eps is not None:  # over each head's features, no scale
            value = rms_norm(value, epsilon=self.value_norm_eps)
        return self._heads(key, self.num_kv_heads, self.key_norm), value

    def _heads(self, x: jax.Array, num_heads: int, norm: QKNorm | None = None) -> jax.Array:
        """[batch, seq, num_heads * head_dim] -> [batch, seq, num_heads, head_dim], normalised
        by `norm` when given."""
        x = x if norm is None else norm(x)
        return x.reshape(*x.shape[:2], num_heads, self.head_dim)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Keys:
    """Keys and values the queries attend, with everything that says which they may see.

    key, value: [batch, kv_len, num_kv_heads, head_dim], or heads-major [batch, num_kv_heads,
      kv_len, head_dim] when `heads_major` (as caches store them).
    positions: int [batch or 1, kv_len] true positions of the keys, or None (distances only).
    mask, bias, is_causal, sparsity, query_segment_ids, key_segment_ids: as in
      `tfx.ops.dot_product_attention`.
    """

    key: jax.Array
    value: jax.Array
    positions: jax.Array | None = None
    mask: jax.Array | None = None
    bias: jax.Array | None = None
    is_causal: bool = static_field(False)
    sparsity: SparsitySpec | None = static_field(None)
    query_segment_ids: jax.Array | None = None
    key_segment_ids: jax.Array | None = None
    heads_major: bool = static_field(False)

    @property
    def kv_len(self) -> int:
        return self.key.shape[2 if self.heads_major else 1]

    def with_bias(self, bias: jax.Array | None) -> Keys:
        """These keys with `bias` added to their score bias (None adds nothing)."""
        if bias is None:
            return self
        return dataclasses.replace(self, bias=bias if self.bias is None else self.bias + bias)

    def attention(self, query: jax.Array, *, scale: float | None, softcap: float | None,
                  implementation: str | None, block_sizes: tuple[int, int] | None,
                  sinks: jax.Array | None = None) -> jax.Array:
        """[batch, q_len, num_heads, head_dim] -> [batch, q_len, num_heads, value_dim]:
        `tfx.ops.dot_product_attention` of the queries over these keys (with the attention's
        sink logits [num_heads], or None)."""
        return dot_product_attention(
            query, self.key, self.value, bias=self.bias, mask=self.mask,
            is_causal=self.is_causal, scale=scale, softcap=softcap, sparsity=self.sparsity,
            query_segment_ids=self.query_segment_ids, key_segment_ids=self.key_segment_ids,
            implementation=implementation, block_sizes=block_sizes,
            heads_major=self.heads_major, sinks=sinks)


class NoCache:
    """Attention over the call's own keys: from `x` (self) or `context` (cross)."""

    def sources(self, x: jax.Array, context: jax.Array | None) -> jax.Array:
        return x if context is None else context

    def query_positions(self, positions: jax.Array | None, q_len: int) -> jax.Array:
        return jnp.arange(q_len) if positions is None else positions

    def attend(self, keys: Keys, x: jax.Array) -> tuple[Keys, None]:
        return keys, None


@dataclasses.dataclass(frozen=True)
class CrossKV(NoCache):
    """A cross-attention's keys and values of one encoder output, computed once
    (`Attention.keys_values`), heads-major; the call projects only its queries."""

    kv: LayerKV

    def sources(self, x, context):
        return None

    def attend(self, keys, x):
        return dataclasses.replace(keys, key=self.kv.key, value=self.kv.value,
                                   heads_major=True), None


@dataclasses.dataclass(frozen=True)
class SharedKeys(NoCache):
    """The keys and values that another layer of the same kind attended in this call
    (`RecordKeys`), with their positions and visibility: the call projects only its queries
    and keeps no cache (Gemma 4's KV sharing)."""

    keys: Keys

    def sources(self, x, context):
        return None

    def attend(self, keys, x):
        return self.keys, None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Recorded:
    """What a layer that records its keys returns as its cache: its next cache state (None
    when it keeps none) and the `Keys` it attended, for the later layers that share them."""

    state: object
    keys: Keys


@dataclasses.dataclass(frozen=True)
class RecordKeys:
    """A cache kind (`inner`) whose call also returns the `Keys` it attended (`Recorded`),
    for the later layers that share them (`SharedKeys`)."""

    inner: NoCache

    def sources(self, x: jax.Array, context: jax.Array | None) -> jax.Array | None:
        return self.inner.sources(x, context)

    def query_positions(self, positions: jax.Array | None, q_len: int) -> jax.Array:
        return self.inner.query_positions(positions, q_len)

    def attend(self, keys: Keys, x: jax.Array) -> tuple[Keys, Recorded]:
        keys, state = self.inner.attend(keys, x)
        return keys, Recorded(state, keys)


def cache_for(cache: NoCache | None, context: jax.Array | LayerKV | None) -> NoCache:
    """The cache kind serving a call: `cache` itself, or for none, the precomputed keys of a
    `LayerKV` context or plain attention."""
    if cache is not None:
        return cache
    return CrossKV(context) if isinstance(context, LayerKV) else NoCache()
