"""Multi-head latent attention (MLA; DeepSeek-V2, 2024, and DeepSeek-V3) as a Flax NNX module.

Per token x [d_model], with H heads:

    q       = W_qb · RMSNorm(W_qa · x)            (or W_q · x without q_lora_rank)
              per head [q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)]
    [c | r] = W_kva · x,  c = RMSNorm(c) (kv_lora_rank),  k_rope = r (qk_rope_head_dim)
    per head [k_nope | v] = W_kvb · c,  key = [k_nope | k_rope]   (k_rope shared by the heads)

with the position (RoPE) applied to q_rope and k_rope only. A cache stores c and the rotated
k_rope (`tfx.ops.kv_cache.LatentKV`): (kv_lora_rank + qk_rope_head_dim) values per token and
layer instead of 2 · H · head_dim.

The kernel can see the cached latents in two ways, with the same result:
- expanded: keys and values of every head from W_kvb · c, then attention per head (as Hugging
  Face does); cheapest when the queries are as many as the keys (training, a whole input);
- absorbed: W_kvb's key half folded into the queries (q_nope · W_uk, per head into latent
  space) and its value half applied after attention, so the kernel attends once over [c |
  k_rope] as a single key/value head (MQA with head_dim kv_lora_rank + qk_rope_head_dim) and
  never expands the cache; cheapest for a few queries over a long cache (decoding).
`LatentAttention(absorb=None)` picks per call from the shapes by counting multiply-adds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn import axes
from tfx.nn.attention import Keys, NoCache
from tfx.nn.caches import KVLayer
from tfx.nn.linear import flat_linear, is_plain
from tfx.nn.norms import make_norm
from tfx.nn.positions import Position
from tfx.ops import _checks, dot_product_attention
from tfx.ops.kv_cache import LatentKV
from tfx.ops.sparse import SparsitySpec

__all__ = ["LatentAttention"]


class LatentAttention(nnx.Module):
    """Multi-head latent attention: low-rank queries, keys and values from a compressed latent
    and one rotary key shared by the heads, through `tfx.ops.dot_product_attention`.

    Submodules map one-to-one onto Hugging Face's DeepseekV3Attention: q_a, q_a_norm, q_b
    (q_a_proj, q_a_layernorm, q_b_proj) or query (q_proj); kv_a (kv_a_proj_with_mqa),
    kv_a_norm (kv_a_layernorm), kv_b (kv_b_proj), out (o_proj).

    Args:
      d_model: width of the input (and of the output).
      num_heads: query heads H (each with its own keys and values from the latent).
      q_lora_rank: width of the compressed query, or None for a plain query projection
        (DeepSeek-V2-Lite).
      kv_lora_rank: width of the compressed latent c, which the cache stores.
      qk_nope_head_dim: query/key features per head without position.
      qk_rope_head_dim: rotary query/key features per head (the key's are shared by the heads).
      v_head_dim: value features per head.
      use_bias: biases on q_a, kv_a and out (HF `attention_bias`); query, q_b and kv_b never
        have one, as in DeepSeek (which also keeps the absorbed form exact).
      scale: score multiplier (default (qk_nope_head_dim + qk_rope_head_dim)^-0.5; DeepSeek
        with YaRN multiplies it by mscale², which its model family supplies).
      position: the encoding of the rotary parts, e.g. `Rotary(theta=..., layout="interleaved",
        scaling=...)` (HF `rope_interleave=True`: HF's permuted pairs give the same scores);
        None: none.
      norm_eps: epsilon of the two RMSNorms.
      softcap: logit soft-capping as in `tfx.ops.dot_product_attention`, or None.
      absorb: True/False forces the absorbed/expanded kernel input (see the module
        docstring); None picks the cheaper per call. A kv_b that is not a plain `nnx.Linear`
        (rewritten, e.g. by fine-tuning, so its kernel may not be all of its weight) always
        runs expanded.
      implementation: as in `tfx.nn.Attention`.
      block_sizes: as in `tfx.nn.Attention`.
      dtype: compute dtype; param_dtype: storage dtype of the weights.
    """

    def __init__(self, d_model: int, num_heads: int, *, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, use_bias: bool = False, scale: float | None = None,
                 position: Position | None = None, norm_eps: float = 1e-6,
                 softcap: float | None = None, absorb: bool | None = None,
                 implementation: str | None = None,
                 block_sizes: tuple[int, int] | None = None, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        for name, size in (("d_model", d_model), ("num_heads", num_heads),
                           ("kv_lora_rank", kv_lora_rank), ("qk_nope_head_dim", qk_nope_head_dim),
                           ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim),
                           *(() if q_lora_rank is None else (("q_lora_rank", q_lora_rank),))):
            _checks.positive_int(name, size)
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim = v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        # Given explicitly to the kernel: the absorbed form attends with another head_dim.
        self.scale = qk_head_dim ** -0.5 if scale is None else scale
        self.softcap, self.absorb = softcap, absorb
        self.implementation, self.block_sizes = implementation, block_sizes
        self.position = Position() if position is None else position

        def linear(features_in, features_out, axes_in, axes_out, bias=False):
            return flat_linear(features_in, features_out, use_bias=bias, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs,
                               kernel_metadata=axes.metadata(axes_in, axes_out))

        def rms(width):
            return make_norm("rms", width, epsilon=norm_eps, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)

        heads_qk = num_heads * qk_head_dim
        if q_lora_rank is None:
            self.query = linear(d_model, heads_qk, axes.EMBED, axes.HEADS)
        else:
            self.q_a = linear(d_model, q_lora_rank, axes.EMBED, None, use_bias)
            self.q_a_norm = rms(q_lora_rank)
            self.q_b = linear(q_lora_rank, heads_qk, None, axes.HEADS)
        self.kv_a = linear(d_model, kv_lora_rank + qk_rope_head_dim, axes.EMBED, None, use_bias)
        self.kv_a_norm = rms(kv_lora_rank)
        self.kv_b = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), None,
                           axes.HEADS)
        self.out = linear(num_heads * v_head_dim, d_model, axes.HEADS, axes.EMBED, use_bias)

    def __call__(self, x: jax.Array, *, positions: jax.Array | None = None,
                 key_positions: jax.Array | None = None, cache: KVLayer | None = None,
                 mask: jax.Array | None = None, bias: jax.Array | None = None,
                 is_causal: bool = False, sparsity: SparsitySpec | None = None,
                 query_segment_ids: jax.Array | None = None,
                 key_segment_ids: jax.Array | None = None):
        """Self-attention of `x`, as `tfx.nn.Attention.__call__` without a context.

        Args:
          x: [batch, q_len, d_model].
          positions: int [batch, q_len] or [q_len], true positions of the queries (default
            0 .. q_len - 1); key_positions likewise for the keys (default: positions).
          cache: `KVLayer(layer, step)` with `layer` a `LatentKV` (a layer of
            `tfx.ops.kv_cache.init_latent_cache`) and the call's `CacheStep`, which then
            supplies positions and the mask; or None.
          mask: as in `tfx.ops.dot_product_attention`, over the attended keys (with a
            cache, pass is_causal=False and let its step's mask decide); so are the next five.
          bias: as in `tfx.ops.dot_product_attention`.
          is_causal: as in `tfx.ops.dot_product_attention`.
          sparsity: as in `tfx.ops.dot_product_attention`.
          query_segment_ids: as in `tfx.ops.dot_product_attention`.
          key_segment_ids: as in `tfx.ops.dot_product_attention`.
        Returns:
          [batch, q_len, d_model]; with a cache, also the layer's next `LatentKV`.
        """
        if x.ndim != 3:
            raise ValueError(f"x must have 3 dims [batch, q_len, d_model], got shape {x.shape}")
        source = self._cache_kind(cache)
        positions = source.query_positions(positions, x.shape[1])
        key_positions = positions if key_positions is None else key_positions
        query, latent, rope_key = self._project(x, positions, key_positions)
        # The cache stores the two arrays of `Keys` as it would keys and values.
        keys, cache = source.attend(Keys(
            latent, rope_key, key_positions, mask, bias, is_causal, sparsity, query_segment_ids,
            key_segment_ids), x)
        query, position_bias = self.position.bias(query, positions, keys.positions, keys.kv_len)
        keys = keys.with_bias(position_bias)
        run = self._absorbed if self._absorbs(x.shape[1], keys.kv_len) else self._expanded
        out = run(query, keys)
        out = self.out(out.reshape(*x.shape[:2], self.num_heads * self.v_head_dim))
        return out if cache is None else (out, cache)

    def _cache_kind(self, cache: KVLayer | None) -> NoCache:
        """The cache kind serving a call; only a latent cache fits this attention."""
        if cache is None:
            return NoCache()
        if not (isinstance(cache, KVLayer) and isinstance(cache.kv, LatentKV)):
            raise ValueError(
                "cache: LatentAttention takes KVLayer(layer, step) with layer a LatentKV (from "
                f"tfx.ops.kv_cache.init_latent_cache), got {type(cache).__name__}"
                + (f" of {type(cache.kv).__name__}" if isinstance(cache, KVLayer) else ""))
        widths = (cache.kv.latent.shape[-1], cache.kv.rope_key.shape[-1])
        if widths != (self.kv_lora_rank, self.qk_rope_head_dim):
            raise ValueError(
                f"cache: latent and rope_key widths {widths} must be (kv_lora_rank, "
                f"qk_rope_head_dim) = {(self.kv_lora_rank, self.qk_rope_head_dim)}")
        return cache

    def _project(self, x: jax.Array, positions: jax.Array,
                 key_positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [batch, seq, d_model] -> query [batch, seq, H, qk_nope_head_dim + qk_rope_head_dim],
        latent [batch, seq, 1, kv_lora_rank] and rope_key [batch, seq, 1, qk_rope_head_dim],
        the rotary parts encoded at their positions."""
        batch, seq = x.shape[:2]
        query = (self.query(x) if self.q_lora_rank is None
                 else self.q_b(self.q_a_norm(self.q_a(x))))
        query = query.reshape(batch, seq, self.num_heads, -1)
        query_nope, query_rope = jnp.split(query, [self.qk_nope_head_dim], axis=-1)
        compressed = self.kv_a(x)[:, :, None, :]  # one "head", as the cache stores it
        latent = self.kv_a_norm(compressed[..., :self.kv_lora_rank])
        query_rope, rope_key = self.position.encode(
            query_rope, compressed[..., self.kv_lora_rank:], positions, key_positions)
        return jnp.concatenate([query_nope, query_rope], axis=-1), latent, rope_key

    def _absorbs(self, q_len: int, kv_len: int) -> bool:
        """Whether this call runs absorbed: forced by `absorb`, else when it costs fewer
        multiply-adds per head than expanding (kv_b over every key, then attention at
        qk_head_dim and v_head_dim) — queries in and out of latent space, then attention at
        kv_lora_rank + qk_rope_head_dim and kv_lora_rank."""
        if not is_plain(self.kv_b):  # its kernel may not be its whole weight
            return False
        if self.absorb is not None:
            return self.absorb
        rank, nope, rope, value = (self.kv_lora_rank, self.qk_nope_head_dim,
                                   self.qk_rope_head_dim, self.v_head_dim)
        expanded = kv_len * rank * (nope + value) + q_len * kv_len * (nope + rope + value)
        absorbed = q_len * rank * (nope + value) + q_len * kv_len * (2 * rank + rope)
        return absorbed < expanded

    def _expanded(self, query: jax.Array, keys: Keys) -> jax.Array:
        """Every head's keys [k_nope | k_rope] and values from the attended latents, then
        attention: query [batch, q_len, H, qk_head_dim] -> [batch, q_len, H, v_head_dim]."""
        latent, rope_key = self._latents(keys, query.dtype)
        expanded = self.kv_b(latent[:, :, 0]).reshape(*latent.shape[:2], self.num_heads, -1)
        key_nope, value = jnp.split(expanded, [self.qk_nope_head_dim], axis=-1)
        rope_key = jnp.broadcast_to(rope_key, (*key_nope.shape[:3], self.qk_rope_head_dim))
        key = jnp.concatenate([key_nope, rope_key.astype(key_nope.dtype)], axis=-1)
        return self._attend(query.astype(key.dtype), key, value, keys)

    def _absorbed(self, query: jax.Array, keys: Keys) -> jax.Array:
        """Attention over the latents as one key/value head: q_nope·W_uk into latent space,
        scores against [c | k_rope], values c, then ·W_uv per head. query [batch, q_len, H,
        qk_head_dim] -> [batch, q_len, H, v_head_dim]."""
        latent, rope_key = self._latents(keys, query.dtype)
        weight = self.kv_b.kernel[...].astype(query.dtype).reshape(
            self.kv_lora_rank, self.num_heads, -1)
        key_up, value_up = jnp.split(weight, [self.qk_nope_head_dim], axis=-1)
        query_nope, query_rope = jnp.split(query, [self.qk_nope_head_dim], axis=-1)
        query = jnp.concatenate(
            [jnp.einsum("bthn,rhn->bthr", query_nope, key_up), query_rope], axis=-1)
        key = jnp.concatenate([latent, rope_key], axis=-1)
        out = self._attend(query, key, latent, keys)
        return jnp.einsum("bthr,rhv->bthv", out, value_up)

    @staticmethod
    def _latents(keys: Keys, dtype) -> tuple[jax.Array, jax.Array]:
        """The attended latent [batch, kv_len, 1, kv_lora_rank] and rotary key [batch, kv_len,
        1, qk_rope_head_dim] in `dtype`, whichever layout the cache gave (for one head,
        heads-major to sequence-major is a reshape, not a transpose)."""
        arrays = (keys.key, keys.value)
        if keys.heads_major:
            arrays = tuple(jnp.swapaxes(a, 1, 2) for a in arrays)
        return tuple(a.astype(dtype) for a in arrays)

    def _attend(self, query: jax.Array, key: jax.Array, value: jax.Array,
                keys: Keys) -> jax.Array:
        """`tfx.ops.dot_product_attention` with the visibility of `keys`; query [batch, q_len,
        H, D], key [batch, kv_len, K, D], value [batch, kv_len, K, V] -> [batch, q_len, H, V]."""
        # Passed only when set, so the call also runs on an op that predates softcap.
        capping = {} if self.softcap is None else {"softcap": self.softcap}
        return dot_product_attention(
            query, key, value, bias=keys.bias, mask=keys.mask, is_causal=keys.is_causal,
            scale=self.scale, sparsity=keys.sparsity, query_segment_ids=keys.query_segment_ids,
            key_segment_ids=keys.key_segment_ids, implementation=self.implementation,
            block_sizes=self.block_sizes, **capping)
