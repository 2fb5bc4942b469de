"""Multi-head attention (MHA / GQA / MQA, self or cross) as a Flax NNX module."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.ops import dot_product_attention
from tfx.ops.attention import IMPLEMENTATIONS, cached_attention, static_spec
from tfx.ops.kv_cache import CacheStep, LayerKV, write
from tfx.ops.positional import (
    RopeScaling,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    transformer_xl_position_embeddings,
    transformer_xl_position_scores,
)
from tfx.ops.prefix import prepend_prefix
from tfx.ops.sparse import SparsitySpec

__all__ = ["Attention", "Rope"]


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary embedding settings applied to queries and keys (see `tfx.ops.positional.apply_rope`).

    theta: base (LLaMA 10000, LLaMA 3 500000); layout: "half" (HF) or "interleaved" (Meta,
    GPT-J); scaling: None or a RopeScaling object; fraction: share of head_dim rotated.
    """

    theta: float = 10000.0
    layout: str = "half"
    scaling: RopeScaling | None = None
    fraction: float = 1.0


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
      scale: score multiplier (default 1/sqrt(head_dim); T5 uses 1.0).
      rope: rotary embeddings on queries and keys (LLaMA, Mistral, GPT-NeoX), or None.
      alibi: add ALiBi biases (Press et al.) computed from the query and key positions.
      relative: Transformer-XL relative attention (Dai et al. 2019): learned content and
        position biases u, v [num_heads, head_dim] and a projection W_R of sinusoidal relative
        embeddings; scores (q + u)·k + (q + v)·W_R R_{i-j}. Causal self-attention only (the
        queries are the last q_len of the keys).
      implementation: an implementation of `tfx.ops.dot_product_attention` ("reference",
        "blocked", "cudnn", "pallas_gpu", "splash") or None (the platform's best, as in the op).
      block_sizes: (block_q, block_k) for the blocked path, or None for the default.
      dtype: compute dtype (e.g. jnp.bfloat16); param_dtype: storage dtype of the weights.

    Attribute `prefix` (prefix tuning, `tfx.peft.Prefix`): None, or a module whose call returns
    learned keys and values, each [num_prefix, num_kv_heads, head_dim]. They are prepended at
    every call after RoPE and after the KV cache is written (caches hold real tokens only);
    every query sees them, with bias 0 (ALiBi, T5, Transformer-XL terms cover real keys only).
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, kv_features: int | None = None,
                 use_bias: bool = False, scale: float | None = None, rope: Rope | None = None,
                 alibi: bool = False, relative: bool = False, implementation: str | None = None,
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
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.implementation, self.block_sizes = scale, implementation, block_sizes
        self.rope, self.alibi, self.d_model = rope, alibi, d_model
        kv_features = d_model if kv_features is None else kv_features

        def linear(features_in, features_out):
            return nnx.Linear(features_in, features_out, use_bias=use_bias, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)

        self.query = linear(d_model, num_heads * head_dim)
        self.key = linear(kv_features, num_kv_heads * head_dim)
        self.value = linear(kv_features, num_kv_heads * head_dim)
        self.out = linear(num_heads * head_dim, d_model)
        # Transformer-XL's W_R, u and v (None unless `relative`).
        self.position_proj = (nnx.Linear(d_model, num_heads * head_dim, use_bias=False,
                                         dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                              if relative else None)
        zeros = jnp.zeros((num_heads, head_dim), param_dtype)
        self.content_bias = nnx.Param(zeros) if relative else None
        self.position_bias = nnx.Param(zeros) if relative else None
        self.prefix = nnx.data(None)  # set by tfx.peft.Prefix.attach; None adds no state

    def __call__(self, x: jax.Array, context: jax.Array | LayerKV | None = None, *,
                 mask: jax.Array | None = None, bias: jax.Array | None = None,
                 is_causal: bool = False, sparsity: SparsitySpec | None = None,
                 query_segment_ids: jax.Array | None = None,
                 key_segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None,
                 key_positions: jax.Array | None = None,
                 cache: LayerKV | jax.Array | None = None,
                 cache_step: CacheStep | None = None):
        """Attend from `x` to `context` (or to `x` itself).

        Args:
          x: [batch, q_len, d_model].
          context: [batch, kv_len, kv_features] for cross-attention, or its keys and values
            already projected (`keys_values`, computed once per encoder output); None for
            self-attention.
          positions: int [batch, q_len] or [q_len], true positions of the queries for RoPE and
            ALiBi (default 0 .. q_len - 1); key_positions likewise for the keys (default: the
            query positions in self-attention, 0 .. kv_len - 1 in cross-attention).
          mask, bias, is_causal, sparsity, query_segment_ids, key_segment_ids: as in
            `tfx.ops.dot_product_attention` (masks broadcast to [batch, heads, q_len, kv_len]).
          cache, cache_step: self-attention decoding: this layer's `LayerKV` and the call's
            `CacheStep` (`tfx.ops.kv_cache`), which supplies positions and the mask. Or, for
            Transformer-XL, `cache` alone: the segment memory [batch, mem_len, d_model] of
            earlier attention inputs, prepended to the keys and values (the mask then covers
            [memory | x]).
        Returns:
          [batch, q_len, d_model]; with a cache, also the updated cache (LayerKV, or the memory
          shifted by q_len, without gradient).
        """
        if x.ndim != 3:
            raise ValueError(f"x must have 3 dims [batch, q_len, d_model], got shape {x.shape}")
        if isinstance(cache, LayerKV) != (cache_step is not None):
            raise ValueError("a LayerKV cache and cache_step must be given together")
        batch, q_len, _ = x.shape
        query = self.query(x).reshape(batch, q_len, self.num_heads, self.head_dim)
        if isinstance(context, LayerKV):
            key, value = context.key, context.value
        elif cache is not None and cache_step is None:  # Transformer-XL segment memory
            if self.position_proj is None:
                raise ValueError("segment memory serves Transformer-XL attention (relative=True)")
            source = jnp.concatenate([cache.astype(x.dtype), x], axis=1)
            key, value = self._project(source)
            cache = jax.lax.stop_gradient(source[:, q_len:])
        else:
            key, value = self._project(x if context is None else context)
        if cache_step is not None:
            if context is not None or self.position_proj is not None:
                raise ValueError("a KV cache serves causal self-attention without Transformer-XL "
                                 "relative positions")
            positions = cache_step.query_positions
            mask = cache_step.mask if mask is None else mask & cache_step.mask
        if self.rope is not None or self.alibi:
            if positions is None:
                positions = jnp.arange(q_len)
            if key_positions is None:
                key_positions = positions if context is None else jnp.arange(key.shape[1])
        if self.rope is not None:
            rope = dict(theta=self.rope.theta, layout=self.rope.layout,
                        scaling=self.rope.scaling, rotary_fraction=self.rope.fraction)
            query = apply_rope(query, positions, **rope)
            if not isinstance(context, LayerKV):
                key = apply_rope(key, key_positions, **rope)
        cached = isinstance(context, LayerKV) or cache_step is not None  # heads-major keys/values
        if cache_step is not None:
            key, value, cache = write(cache, key, value, cache_step)
            key_positions = cache_step.key_positions
        if self.alibi:
            alibi = alibi_bias(alibi_slopes(self.num_heads), positions, key_positions)
            alibi = alibi if alibi.ndim == 4 else alibi[None]
            bias = alibi if bias is None else bias + alibi
        if self.position_proj is not None:
            query, relative = self._relative(query, key.shape[1])
            bias = relative if bias is None else bias + relative
        if self.prefix is not None:
            key, value, mask, bias, sparsity = prepend_prefix(
                self.prefix(), key, value, heads_major=cached, mask=mask, bias=bias,
                spec=None if cached else static_spec(is_causal, sparsity),
                query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids)
            is_causal, query_segment_ids, key_segment_ids = False, None, None
        if cached:
            out = cached_attention(query, key, value, bias=bias, mask=mask, scale=self.scale)
        else:
            out = dot_product_attention(
                query, key, value, bias=bias, mask=mask, is_causal=is_causal, scale=self.scale,
                sparsity=sparsity, query_segment_ids=query_segment_ids,
                key_segment_ids=key_segment_ids, implementation=self.implementation,
                block_sizes=self.block_sizes,
            )
        out = self.out(out.reshape(batch, q_len, self.num_heads * self.head_dim))
        return out if cache is None else (out, cache)

    def keys_values(self, context: jax.Array) -> LayerKV:
        """[batch, kv_len, kv_features] -> keys and values [batch, num_kv_heads, kv_len,
        head_dim] (heads-major, as caches hold them), to cache a cross-attention's once per
        encoder output."""
        return LayerKV(*(jnp.swapaxes(x, 1, 2) for x in self._project(context)))

    def _project(self, source: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[batch, kv_len, features] -> keys and values [batch, kv_len, num_kv_heads, head_dim]."""
        shape = (*source.shape[:2], self.num_kv_heads, self.head_dim)
        return self.key(source).reshape(shape), self.value(source).reshape(shape)

    def _relative(self, query: jax.Array, kv_len: int) -> tuple[jax.Array, jax.Array]:
        """Transformer-XL: the query with the content bias u added, and the position term as a
        bias already multiplied by the score scale (the kernel scales only q·k)."""
        table = transformer_xl_position_embeddings(kv_len, self.d_model).astype(query.dtype)
        position_keys = self.position_proj(table).reshape(kv_len, self.num_heads, self.head_dim)
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        terms = transformer_xl_position_scores(
            query, position_keys, self.position_bias[...].astype(query.dtype))
        return query + self.content_bias[...].astype(query.dtype), terms * scale

