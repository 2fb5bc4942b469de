"""Multi-head attention (MHA / GQA / MQA, self or cross) as a Flax NNX module.

A call reads top to bottom: project queries (and the call's keys and values), encode positions
(`tfx.nn.positions`), take what the cache adds (`tfx.nn.caches`), run the kernel
(`tfx.ops.dot_product_attention`), project the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx import names
from tfx.nn import axes
from tfx.nn.caches import Keys, NoCache, cache_for
from tfx.nn.linear import flat_linear
from tfx.nn.norms import make_norm
from tfx.nn.positions import Position
from tfx.nn.remat import KEY_PROJ, QUERY_PROJ, VALUE_PROJ, tag
from tfx.ops.attention import IMPLEMENTATIONS
from tfx.ops.kv_cache import LayerKV
from tfx.ops.sparse import SparsitySpec

__all__ = ["QK_NORMS", "Attention", "QKNorm"]

QK_NORMS = names.QK_NORMS


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
        self.key = linear(kv_features, num_kv_heads * head_dim, axes.EMBED, axes.HEADS,
                          axes.HEADS)
        self.value = linear(kv_features, num_kv_heads * head_dim, axes.EMBED, axes.HEADS,
                            axes.HEADS)
        self.out = linear(num_heads * head_dim, d_model, axes.HEADS, axes.EMBED, None,
                          use_bias if out_bias is None else out_bias)
        self.query_norm, self.key_norm = (
            (None, None) if qk_norm is None else
            (QKNorm(qk_norm, num_heads, head_dim, norm_eps, dtype, param_dtype, rngs),
             QKNorm(qk_norm, num_kv_heads, head_dim, norm_eps, dtype, param_dtype, rngs)))

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
          cache: a cache kind of `tfx.nn.caches` (a KV cache layer with its step, which then
            supplies positions and the mask, or a Transformer-XL memory), or None.
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
        query = self._heads(tag(self.query(x), QUERY_PROJ), self.num_heads, self.query_norm)
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
                             implementation=self.implementation, block_sizes=self.block_sizes)
        out = self.out(out.reshape(*x.shape[:2], self.num_heads * self.head_dim))
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
        return (self._heads(tag(self.key(source), KEY_PROJ), self.num_kv_heads, self.key_norm),
                self._heads(tag(self.value(source), VALUE_PROJ), self.num_kv_heads))

    def _heads(self, x: jax.Array, num_heads: int, norm: QKNorm | None = None) -> jax.Array:
        """[batch, seq, num_heads * head_dim] -> [batch, seq, num_heads, head_dim], normalised
        by `norm` when given."""
        x = x if norm is None else norm(x)
        return x.reshape(*x.shape[:2], num_heads, self.head_dim)


class QKNorm(nnx.Module):
    """RMSNorm of projected queries or keys [batch, seq, heads · head_dim]: over each head's
    head_dim features ("per_head", one scale [head_dim] shared by the heads) or over all
    features at once ("across_heads", a scale [heads · head_dim])."""

    def __init__(self, kind: str, num_heads: int, head_dim: int, eps: float, dtype, param_dtype,
                 rngs: nnx.Rngs):
        if kind not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS} or None, got {kind!r}")
        self.width = head_dim if kind == "per_head" else num_heads * head_dim
        self.norm = make_norm("rms", self.width, epsilon=eps, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        groups = x.reshape(*x.shape[:-1], -1, self.width)
        return self.norm(groups).reshape(x.shape)
