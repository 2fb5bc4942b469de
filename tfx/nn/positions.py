"""Positional encodings that act inside attention, as small parts behind one interface.

An attention layer holds one `Position` and calls it twice:

- `encode(query, key, query_positions, key_positions) -> (query, key)` on the call's new
  queries and keys, before a cache stores the keys (RoPE rotates them here, so caches hold
  rotated keys and never rotate them again);
- `bias(query, query_positions, key_positions, kv_len) -> (query, bias)` once every key the
  queries attend is known (cached ones included): a score bias [batch or 1, heads, q_len,
  kv_len] or None, and the query the kernel scores with (Transformer-XL adds its content
  bias u there).

`Position` itself is NoPE (Kazemnejad et al. 2023): it changes nothing. A new encoding is a new
subclass here, never a branch in `tfx.nn.Attention`. Encodings added to the embeddings
(learned, sinusoidal) live in `tfx.nn.embeddings`; T5's bias, one table shared by a stack's
layers, in `tfx.nn.relative_bias` (the stack computes it once and passes it as `bias`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn import axes
from tfx.nn.linear import flat_linear
from tfx.ops.positional import (
    RopeScaling,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    transformer_xl_position_embeddings,
    transformer_xl_position_scores,
)

__all__ = ["ALiBi", "Position", "Rotary", "TransformerXL"]


class Position(nnx.Module):
    """No positional information in attention (NoPE); the base of every encoding."""

    def encode(self, query: jax.Array, key: jax.Array | None, query_positions: jax.Array,
               key_positions: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """query [batch, q_len, heads, head_dim], key [batch, new_len, kv_heads, head_dim] (None
        when the call brings no new keys) at int positions [batch or 1, len] -> same shapes."""
        return query, key

    def bias(self, query: jax.Array, query_positions: jax.Array,
             key_positions: jax.Array | None, kv_len: int) -> tuple[jax.Array, jax.Array | None]:
        """The query to score with and a bias over the kv_len keys attended (whose true
        positions are key_positions [batch or 1, kv_len], None where only distances exist)."""
        return query, None


class Rotary(Position):
    """RoPE (Su et al. 2021): queries and keys rotated by their positions, so that scores
    depend on distances only. Keys are rotated once, before a cache stores them."""

    def __init__(self, *, theta: float = 10000.0, layout: str = "half",
                 scaling: RopeScaling | None = None, rotary_fraction: float = 1.0):
        """The settings of `tfx.ops.positional.apply_rope`, under its names (a model takes
        them from its `tfx.models.parts.RopeConfig`)."""
        # Plain attributes, not a dict: they are static data of the model's graph, which jit
        # hashes.
        self.theta, self.layout, self.scaling = theta, layout, scaling
        self.rotary_fraction = rotary_fraction

    def encode(self, query, key, query_positions, key_positions):
        rope = dict(theta=self.theta, layout=self.layout, scaling=self.scaling,
                    rotary_fraction=self.rotary_fraction)
        query = apply_rope(query, query_positions, **rope)
        return query, None if key is None else apply_rope(key, key_positions, **rope)


class ALiBi(Position):
    """ALiBi (Press et al. 2022): a per-head linear penalty on the key-query distance."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads

    def bias(self, query, query_positions, key_positions, kv_len):
        bias = alibi_bias(alibi_slopes(self.num_heads), query_positions, key_positions)
        return query, bias if bias.ndim == 4 else bias[None]


class TransformerXL(Position):
    """Transformer-XL relative attention (Dai et al. 2019): learned content and position
    biases u, v [num_heads, head_dim] and a projection W_R of sinusoidal relative embeddings;
    scores (q + u)·k + (q + v)·W_R R_{i-j}. The queries are the last q_len of the kv_len keys
    (causal self-attention over [memory | segment]), so only distances are needed.

    scale: the attention's score multiplier (the kernel scales only q·k, so the position term
    is scaled here).
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, scale: float, dtype,
                 param_dtype, rngs: nnx.Rngs):
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        self.scale = scale
        self.position_proj = flat_linear(d_model, num_heads * head_dim, use_bias=False,
                                         dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                         kernel_metadata=axes.metadata(axes.EMBED, axes.HEADS))
        zeros = jnp.zeros((num_heads, head_dim), param_dtype)
        self.content_bias = nnx.Param(zeros)
        self.position_bias = nnx.Param(zeros)

    def bias(self, query, query_positions, key_positions, kv_len):
        table = transformer_xl_position_embeddings(kv_len, self.d_model).astype(query.dtype)
        position_keys = self.position_proj(table).reshape(kv_len, self.num_heads, self.head_dim)
        terms = transformer_xl_position_scores(
            query, position_keys, self.position_bias[...].astype(query.dtype))
        return query + self.content_bias[...].astype(query.dtype), terms * self.scale
