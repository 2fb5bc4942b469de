"""One transformer layer built from a config: attention, optional cross-attention, MLP, with
pre- or post-normalisation and residual dropout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models.config import TransformerConfig, compute_dtype
from tfx.nn.attention import Attention, Rope
from tfx.nn.dropout import make_dropout
from tfx.nn.mlp import MLP
from tfx.nn.moe import MoE
from tfx.nn.norms import make_norm
from tfx.ops.backends import current_platform
from tfx.ops.kv_cache import LayerKV

__all__ = ["Block", "dtypes"]


def dtypes(config: TransformerConfig, platform: str | None = None) -> dict:
    """The dtype / param_dtype keyword arguments of every module of a model built on `platform`
    (default: the one running here); config.compute.dtype None gives the platform's compute dtype
    (`tfx.models.config.compute_dtype`: bfloat16 on GPU/TPU, float32 on CPU)."""
    return {"dtype": compute_dtype(config.compute.dtype, platform or current_platform()),
            "param_dtype": jnp.dtype(config.compute.param_dtype)}


class Block(nnx.Module):
    """x -> x + attention -> [x + cross-attention] -> x + MLP (or mixture of experts, `moe`).

    Pre-norm (GPT-2, LLaMA, T5): x + f(norm(x)); post-norm (BERT, original Transformer):
    norm(x + f(x)). Dropout is applied to each branch before the residual sum.

    Bottleneck adapters (`tfx.peft.Adapters`) hook in as `attention_adapter`, `cross_adapter`
    and `mlp_adapter` (None when absent): each maps its branch's output f(.) before dropout and
    the residual sum, [batch, seq, d_model] -> same, for pre- and post-norm alike.
    """

    def __init__(self, config: TransformerConfig, *, cross_attention: bool = False,
                 moe: bool = False, rngs: nnx.Rngs):
        c = config
        kinds = dtypes(c)
        rope = None
        if c.position == "rope":
            rope = Rope(c.rope.theta, c.rope.layout, c.rope.scaling, c.rope.fraction)

        def attention(**kwargs):
            return Attention(c.d_model, c.num_heads, num_kv_heads=c.kv_heads,
                             head_dim=c.attention.head_dim, use_bias=c.use_bias,
                             scale=c.attention.scale, implementation=c.attention.implementation,
                             rngs=rngs, **kinds, **kwargs)

        def norm():
            return make_norm(c.norm.kind, c.d_model, epsilon=c.norm.eps, rngs=rngs, **kinds)

        self.pre_norm = c.norm.pre_norm
        self.attention = attention(rope=rope, alibi=c.position == "alibi",
                                   relative=c.position == "xl")
        self.attention_norm = norm()
        self.cross_attention = attention() if cross_attention else None
        self.cross_norm = norm() if cross_attention else None
        if moe:
            self.mlp = MoE(c.d_model, c.moe.d_ff or c.d_ff, num_experts=c.moe.num_experts,
                           experts_per_token=c.moe.experts_per_token, activation=c.mlp.activation,
                           gated=c.mlp.gated, capacity_factor=c.moe.capacity_factor,
                           policy=c.moe.policy, jitter=c.moe.jitter,
                           implementation=c.moe.dispatch, shared_experts=c.moe.shared_experts,
                           rngs=rngs, **kinds)
        else:
            self.mlp = MLP(c.d_model, c.d_ff, activation=c.mlp.activation, gated=c.mlp.gated,
                           use_bias=c.use_bias, rngs=rngs, **kinds)
        self.mlp_norm = norm()
        self.dropout = make_dropout(c.dropout, rngs=rngs)
        # Set by tfx.peft.Adapters.attach; None adds no state.
        self.attention_adapter = nnx.data(None)
        self.cross_adapter = nnx.data(None)
        self.mlp_adapter = nnx.data(None)

    def __call__(self, x: jax.Array, *, context: jax.Array | LayerKV | None = None,
                 context_mask: jax.Array | None = None, cache: LayerKV | None = None,
                 token_mask: jax.Array | None = None,
                 **attention_args) -> jax.Array | tuple[jax.Array, LayerKV]:
        """[batch, seq, d_model] -> same (and the updated self-attention cache, given one).

        Args:
          context: encoder output [batch, src_len, d_model] for the cross-attention layer, or
            its keys and values cached by `cross_attention.keys_values`.
          context_mask: bool mask for the cross-attention, broadcastable to
            [batch, heads, seq, src_len].
          cache: this layer's self-attention LayerKV (with `cache_step` in attention_args).
          token_mask: bool [batch, seq], False for padding, for a mixture of experts (which
            then routes padding nowhere); ignored by a dense MLP.
          attention_args: mask, bias, is_causal, sparsity, positions, segment ids, cache_step
            of the self-attention (see `tfx.nn.Attention`).
        """
        def attend(h):
            nonlocal cache
            if cache is None:
                return self.attention(h, **attention_args)
            h, cache = self.attention(h, cache=cache, **attention_args)
            return h

        x = self._residual(x, self.attention_norm, attend, self.attention_adapter)
        if self.cross_attention is not None:
            x = self._residual(x, self.cross_norm,
                               lambda h: self.cross_attention(h, context, mask=context_mask),
                               self.cross_adapter)
        def feed_forward(h):
            return self.mlp(h, token_mask) if isinstance(self.mlp, MoE) else self.mlp(h)

        x = self._residual(x, self.mlp_norm, feed_forward, self.mlp_adapter)
        return x if cache is None else (x, cache)

    def _residual(self, x, norm, branch, adapter):
        def adapted(h):
            out = branch(h)
            return out if adapter is None else adapter(out)

        if self.pre_norm:
            return x + self.dropout(adapted(norm(x)))
        return norm(x + self.dropout(adapted(x)))
