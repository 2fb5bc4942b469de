"""LLaMA's forward pass in one file: the reading copy of tfx.

Read this first. It is everything a tfx decoder computes with LLaMA's choices (RMSNorm, rotary
positions, grouped-query attention, a SwiGLU MLP), in plain `jax.numpy` from top to bottom,
without what makes the library long: no caches, no kernels picked by platform, no sharding, no
fine-tuning hooks, no other model families. `tests/test_reading_copy.py` checks that it gives
the logits of `tfx.models.create("char-gpt")` and of "llama-tiny", so it stays true.

Where each piece lives in tfx:

  forward         tfx/models/decoder.py (Decoder), the layer loop in tfx/models/stack.py
  one layer       tfx/models/block.py (Block): x + attention(norm(x)), then x + mlp(norm(x))
  rms_norm        tfx/ops/norms.py
  apply_rope      tfx/ops/positional/rope.py (layout "half"), used by tfx/nn/positions.py
  attention       tfx/nn/attention.py (Attention); the kernels in tfx/ops/attention/
  mlp             tfx/nn/mlp.py (MLP with gated=True, activation="silu")

The weights are a flat dict keyed by tfx's own parameter paths (`tfx.nn.paths.path_name`), so
each name also says where the parameter lives in a tfx model:

  "embeddings/tokens/table"                    [vocab, d_model]
  "stack/layers/{i}/attention_norm/scale"      [d_model]
  "stack/layers/{i}/attention/query/kernel"    [d_model, num_heads * head_dim]
  "stack/layers/{i}/attention/key/kernel"      [d_model, num_kv_heads * head_dim]
  "stack/layers/{i}/attention/value/kernel"    [d_model, num_kv_heads * head_dim]
  "stack/layers/{i}/attention/out/kernel"      [num_heads * head_dim, d_model]
  "stack/layers/{i}/mlp_norm/scale"            [d_model]
  "stack/layers/{i}/mlp/gate/kernel"           [d_model, d_ff]
  "stack/layers/{i}/mlp/up/kernel"             [d_model, d_ff]
  "stack/layers/{i}/mlp/down/kernel"           [d_ff, d_model]
  "stack/final_norm/scale"                     [d_model]
  "head/kernel"                                [d_model, vocab]; absent when tied

Kernels are [in, out] and apply as `x @ kernel`, as Flax stores them (PyTorch and Hugging Face
store the transpose).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    """The numbers that the weights' shapes do not say."""

    num_layers: int
    num_heads: int
    num_kv_heads: int  # divides num_heads; equal is plain multi-head attention
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x [..., d] divided by its root mean square over d, times scale [d]."""
    # No mean subtracted and no bias, unlike LayerNorm: LLaMA found the rescaling alone enough.
    # The statistics are float32 whatever x's dtype, as in every tfx norm.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * scale).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary positions: x [batch, seq, heads, head_dim] rotated by positions int [seq].

    Feature i pairs with feature i + head_dim / 2 (the "half" layout of Hugging Face's LLaMA
    and GPT-NeoX; Meta's code pairs neighbours, a fixed permutation of the same model), and
    each pair turns by the angle position · theta^(-2i / head_dim).
    """
    # Queries and keys both turn, so their dot product depends on how far apart two tokens
    # are, not on where they are: nothing is added to the embeddings.
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions.astype(jnp.float32)[:, None, None] * inv_freq  # [seq, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def attention(x: jax.Array, weights: dict, prefix: str, config: Config) -> jax.Array:
    """Causal self-attention with rotary positions: [batch, seq, d_model] -> the same."""
    batch, seq, _ = x.shape
    query = (x @ weights[prefix + "query/kernel"]).reshape(batch, seq, config.num_heads, -1)
    key = (x @ weights[prefix + "key/kernel"]).reshape(batch, seq, config.num_kv_heads, -1)
    value = (x @ weights[prefix + "value/kernel"]).reshape(batch, seq, config.num_kv_heads, -1)
    positions = jnp.arange(seq)
    query = apply_rope(query, positions, config.rope_theta)
    key = apply_rope(key, positions, config.rope_theta)  # values carry content, not position

    # Grouped-query attention: fewer key/value heads make the KV cache smaller. Query head h
    # reads key/value head h // group, the layout of jax.nn.dot_product_attention.
    group = config.num_heads // config.num_kv_heads
    key, value = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)

    # 1/sqrt(head_dim) keeps the scores' variance near 1, so softmax does not saturate at init.
    scale = query.shape[-1] ** -0.5
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key).astype(jnp.float32) * scale
    # A token may look at itself and the tokens before it: the model learns to predict the
    # next token, which it must not see.
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    # Softmax in float32 even when activations are bfloat16: its exponentials overflow first.
    probs = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, value).reshape(batch, seq, -1)
    return out @ weights[prefix + "out/kernel"]


def mlp(x: jax.Array, weights: dict, prefix: str) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x)), [batch, seq, d_model] -> the same."""
    # The gate lets each hidden unit scale its own value; at equal parameters this trains
    # better than a plain silu(up(x)) (Shazeer 2020), hence three matrices instead of two.
    hidden = jax.nn.silu(x @ weights[prefix + "gate/kernel"]) * (x @ weights[prefix + "up/kernel"])
    return hidden @ weights[prefix + "down/kernel"]


def forward(weights: dict, tokens: jax.Array, config: Config) -> jax.Array:
    """Next-token logits: tokens int [batch, seq] -> float32 [batch, seq, vocab].

    Logits at position t score the token at t + 1, having seen tokens 0 .. t.
    """
    table = weights["embeddings/tokens/table"]
    x = table[tokens]  # [batch, seq, d_model]; no positions added here: rope adds them
    for i in range(config.num_layers):
        layer = f"stack/layers/{i}/"
        # Pre-norm residual: each branch reads a normalised copy and adds to the stream, so
        # the stream itself passes through every layer untouched and gradients reach the
        # first layers.
        normed = rms_norm(x, weights[layer + "attention_norm/scale"], config.norm_eps)
        x = x + attention(normed, weights, layer + "attention/", config)
        normed = rms_norm(x, weights[layer + "mlp_norm/scale"], config.norm_eps)
        x = x + mlp(normed, weights, layer + "mlp/")
    # The stream grows layer by layer; one last norm brings it to the head's scale.
    x = rms_norm(x, weights["stack/final_norm/scale"], config.norm_eps)
    # Tied embeddings: the table that turns ids into vectors also scores vectors against ids.
    head = weights.get("head/kernel", table.T)
    return (x @ head).astype(jnp.float32)
