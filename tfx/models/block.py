"""One transformer layer built from a config: attention, optional cross-attention, MLP, with
pre- or post-normalisation and residual dropout."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tfx.models.config import MoeConfig, TransformerConfig, compute_dtype
from tfx.nn.attention import Attention, NoCache
from tfx.nn.dropout import make_dropout
from tfx.nn.gated_delta_net import GatedDeltaNet
from tfx.nn.latent_attention import LatentAttention
from tfx.nn.mlp import MLP
from tfx.nn.moe import MoE
from tfx.nn.norms import make_norm
from tfx.nn.per_layer_embeddings import PerLayerInput
from tfx.nn.positions import ALiBi, Position, Rotary, TransformerXL
from tfx.nn.remat import ATTENTION_OUT, MLP_OUT, checkpoint_policy
from tfx.ops.backends import current_platform
from tfx.ops.kv_cache import LayerKV

__all__ = ["Block", "RematBlock", "dtypes", "model_norm"]


def dtypes(config: TransformerConfig, platform: str | None = None) -> dict:
    """The dtype / param_dtype keyword arguments of every module of a model built on `platform`
    (default: the one running here); config.compute.dtype None gives the platform's compute dtype
    (`tfx.models.config.compute_dtype`: bfloat16 on GPU/TPU, float32 on CPU)."""
    return {"dtype": compute_dtype(config.compute.dtype, platform or current_platform()),
            "param_dtype": jnp.dtype(config.compute.param_dtype)}


def model_norm(config: TransformerConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """The model's norm over d_model features (norm.kind, eps and bias) in its dtypes."""
    c = config
    return make_norm(c.norm.kind, c.d_model, epsilon=c.norm.eps, bias=c.norm.bias, rngs=rngs,
                     **dtypes(c))


class Block(nnx.Module):
    """x -> x + attention -> [x + cross-attention] -> x + MLP (or mixture of experts, `moe`).

    Pre-norm (GPT-2, LLaMA, T5): x + f(norm(x)); post-norm (BERT, original Transformer):
    norm(x + f(x)). Pre-norm layers may also normalise each branch's output, x +
    norm2(f(norm1(x))) (Gemma 2 and 3: `norm.outputs`), or only the output (OLMo 2:
    `norm.inputs` False); with `mlp.parallel` the MLP reads the layer's input beside the
    attention (GPT-NeoX). Dropout is applied to each branch before the residual sum.

    layer_type: "full", "sliding" or "linear" (`TransformerConfig.layer_type`): a sliding layer
      rotates with rope.local_theta when the config has one (the window itself is the stack's
      mask); a linear layer mixes tokens with Gated DeltaNet (config.linear) in attention's
      place, its cache a `tfx.nn.DeltaState`.
    positional: False for a layer whose self-attention encodes no positions (NoPE:
      `TransformerConfig.has_positions`).
    attention_norm: False for a pre-norm layer whose attention reads its input unnormalised
      (ModernBERT's first layer: `norm.first_attention`).
    shares_keys: True for a layer that attends an earlier layer's keys and values
      (attention.shared_kv_layers; the stack passes them as its cache, `SharedKeys`): its
      attention then has no key and value projections.
    """

    def __init__(self, config: TransformerConfig, *, cross_attention: bool = False,
                 moe: bool = False, layer_type: str = "full", positional: bool = True,
                 attention_norm: bool = True, shares_keys: bool = False, rngs: nnx.Rngs):
        c = config
        self.pre_norm, self.parallel_mlp = c.norm.pre_norm, c.mlp.parallel
        inputs = c.norm.inputs or not c.norm.pre_norm
        position = _position(c, layer_type, rngs) if positional else None
        self.attention = _token_mixer(c, layer_type, position, shares_keys, rngs)
        self.attention_norm = self._norm(c, inputs and attention_norm, rngs)
        self.attention_output_norm = self._norm(c, c.norm.outputs, rngs)
        self.cross_attention = _attention(c, layer_type, rngs) if cross_attention else None
        self.cross_norm = self._norm(c, inputs and cross_attention, rngs)
        self.cross_output_norm = self._norm(c, c.norm.outputs and cross_attention, rngs)
        self.mlp = _feed_forward(c, moe, shares_keys, rngs)
        self.mlp_norm = self._norm(c, inputs, rngs)
        self.mlp_output_norm = self._norm(c, c.norm.outputs, rngs)
        self.dropout = make_dropout(c.dropout, rngs=rngs)
        self.per_layer_input, self.layer_scale = _layer_output_parts(c, rngs)

    @staticmethod
    def _norm(config: TransformerConfig, present: bool, rngs: nnx.Rngs) -> nnx.Module | None:
        """The model's norm where the layer has one (`present`), else None."""
        return model_norm(config, rngs=rngs) if present else None

    def __call__(self, x: jax.Array, *, context: jax.Array | LayerKV | None = None,
                 context_mask: jax.Array | None = None,
                 context_segment_ids: jax.Array | None = None, cache: NoCache | None = None,
                 token_mask: jax.Array | None = None, per_layer_input: jax.Array | None = None,
                 **attention_args) -> jax.Array | tuple[jax.Array, LayerKV | jax.Array]:
        """[batch, seq, d_model] -> same (and the updated self-attention cache, given one).

        Args:
          context: encoder output [batch, src_len, d_model] for the cross-attention layer, or
            its keys and values cached by `cross_attention.keys_values`.
          context_mask: bool mask for the cross-attention, broadcastable to
            [batch, heads, seq, src_len].
          context_segment_ids: int [batch, src_len], the segments of a packed `context`: a
            query of segment k (the self-attention's `query_segment_ids`) then sees only the
            context of segment k.
          cache: this layer's self-attention cache, a kind of `tfx.nn.caches` (KVLayer,
            SegmentLayer), or a linear layer's `DeltaState`; the layer then also returns its
            next state.
          token_mask: bool [batch, seq], False for padding, for a mixture of experts (which
            then routes padding nowhere) and a linear layer (which reads padding as zeros);
            ignored by a dense MLP and attention.
          per_layer_input: [batch, seq, embeddings.per_layer_width], this layer's slice of the
            per-layer embeddings (`tfx.nn.per_layer_embeddings.PerLayerEmbeddings`), when the
            config has them.
          attention_args: mask, bias, is_causal, sparsity, positions, segment ids of the
            self-attention (see `tfx.nn.Attention`).
        """
        # Named scopes label the compiled ops for profiles (layer_3/attention/...); the tags
        # name the branch outputs for the remat policies that keep them (tfx.nn.remat).
        h = self.branch_input("attention", x)
        with jax.named_scope("attention"):
            if isinstance(self.attention, GatedDeltaNet):  # positions and masks mean nothing
                h = self.attention(h, cache, token_mask=token_mask)
            else:
                h = self.attention(h, cache=cache, **attention_args)
        # A cache kind that keeps no state of its own (SharedKeys) gives the output alone;
        # RecordKeys gives its state with the keys (`Recorded`), which the block passes on.
        h, cache = h if isinstance(h, tuple) else (h, None)
        layer_input, x = x, self.residual("attention", x, checkpoint_name(h, ATTENTION_OUT))
        if self.cross_attention is not None:
            segments = {} if context_segment_ids is None else dict(
                query_segment_ids=attention_args.get("query_segment_ids"),
                key_segment_ids=context_segment_ids)
            h = self.branch_input("cross", x)
            with jax.named_scope("cross_attention"):
                h = self.cross_attention(h, context, mask=context_mask, **segments)
            x = self.residual("cross", x, checkpoint_name(h, ATTENTION_OUT))
        h = self.branch_input("mlp", layer_input if self.parallel_mlp else x)
        with jax.named_scope("mlp"):
            h = self.mlp(h, token_mask) if isinstance(self.mlp, MoE) else self.mlp(h)
        x = self.residual("mlp", x, checkpoint_name(h, MLP_OUT))
        if self.per_layer_input is not None:  # Gemma 4's per-layer embeddings
            x = self.per_layer_input(x, per_layer_input)
        if self.layer_scale is not None:
            x = x * self.layer_scale[...].astype(x.dtype)
        return x if cache is None else (x, cache)

    def branch_input(self, branch: str, x: jax.Array) -> jax.Array:
        """What branch "attention", "cross" or "mlp" reads: its norm of x (pre-norm layers
        that normalise inputs) or x."""
        norm = getattr(self, f"{branch}_norm")
        if not self.pre_norm or norm is None:
            return x
        with jax.named_scope(f"{branch}_norm"):
            return norm(x)

    def residual(self, branch: str, x: jax.Array, h: jax.Array) -> jax.Array:
        """x plus the branch's output h [batch, seq, d_model] (normalised first when the layer
        normalises outputs), dropped out; post-norm models then normalise the sum. A subclass
        may transform h first."""
        if self.pre_norm:
            output_norm = getattr(self, f"{branch}_output_norm")
            h = h if output_norm is None else output_norm(h)
            return x + self.dropout(h)
        return getattr(self, f"{branch}_norm")(x + self.dropout(h))


class RematBlock(Block):
    """A Block whose activations are recomputed in the backward pass instead of stored
    (config.compute.remat). With the default policy, "nothing_saveable", it keeps only the
    layer's inputs; compute.remat_policy names what else it keeps (`tfx.nn.remat.POLICIES`)."""

    def __init__(self, config: TransformerConfig, **kwargs):
        super().__init__(config, **kwargs)
        self.remat_policy = config.compute.remat_policy

    def __call__(self, x: jax.Array, **kwargs):
        policy = checkpoint_policy(self.remat_policy)
        return nnx.remat(lambda block, h: Block.__call__(block, h, **kwargs),
                         policy=policy)(self, x)


def _attention(config: TransformerConfig, layer_type: str, rngs: nnx.Rngs,
               **options) -> Attention:
    """An `Attention` of a layer of `layer_type` (its heads: `TransformerConfig.layer_heads`),
    with the config's attention options and `options` (position, sinks, ...) on top."""
    c = config
    kv_heads, head_dim = c.layer_heads(layer_type)
    return Attention(c.d_model, c.num_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     use_bias=c.use_bias, qkv_bias=c.attention.qkv_bias,
                     out_bias=c.attention.out_bias, qk_norm=c.attention.qk_norm,
                     norm_eps=c.norm.eps, scale=c.attention.scale,
                     softcap=c.attention.softcap, value_norm=c.attention.value_norm,
                     implementation=c.attention.implementation, rngs=rngs, **dtypes(c),
                     **options)


def _token_mixer(config: TransformerConfig, layer_type: str, position: Position | None,
                 shares_keys: bool, rngs: nnx.Rngs) -> nnx.Module:
    """What mixes a layer's tokens: Gated DeltaNet for a "linear" layer, latent attention
    when the config has `latent` (decoders only), else self-attention with its options."""
    c, kinds = config, dtypes(config)
    if layer_type == "linear":
        return GatedDeltaNet(c.d_model, **dataclasses.asdict(c.linear), norm_eps=c.norm.eps,
                             rngs=rngs, **kinds)
    latent = getattr(c, "latent", None)
    if latent is not None:
        return LatentAttention(
            c.d_model, c.num_heads, **dataclasses.asdict(latent), use_bias=c.use_bias,
            scale=c.attention.scale, position=position, norm_eps=c.norm.eps,
            softcap=c.attention.softcap, implementation=c.attention.implementation,
            rngs=rngs, **kinds)
    return _attention(c, layer_type, rngs, position=position, sinks=c.attention.sinks,
                      output_gate=c.attention.output_gate, projects_keys=not shares_keys,
                      values_are_keys=layer_type == "full" and c.attention.full_values_are_keys)


def _feed_forward(config: TransformerConfig, moe: bool, shares_keys: bool,
                  rngs: nnx.Rngs) -> MLP | MoE:
    """A layer's feed-forward part: a mixture of experts (`moe`), else an MLP, twice as wide
    in a layer that shares keys when the config says so (mlp.wide_shared, Gemma 4)."""
    c, kinds = config, dtypes(config)
    if moe:
        return MoE(c.d_model, c.moe.d_ff or c.d_ff, activation=c.mlp.activation,
                   gated=c.mlp.gated, implementation=c.moe.dispatch, **_moe_options(c.moe),
                   rngs=rngs, **kinds)
    width = c.d_ff * (2 if shares_keys and c.mlp.wide_shared else 1)
    return MLP(c.d_model, width, activation=c.mlp.activation, gated=c.mlp.gated,
               use_bias=c.use_bias, rngs=rngs, **kinds)


def _layer_output_parts(config: TransformerConfig, rngs: nnx.Rngs) -> tuple:
    """What a layer does to its output after the MLP's residual: add its per-layer input
    (`PerLayerInput`, embeddings.per_layer_width) and scale by a learned scalar
    (norm.layer_scale, ones at init); None for each the config lacks."""
    c, kinds = config, dtypes(config)
    width = c.embeddings.per_layer_width
    per_layer = None if width is None else PerLayerInput(
        c.d_model, width, activation=c.mlp.activation, eps=c.norm.eps, rngs=rngs, **kinds)
    scale = nnx.Param(jnp.ones((1,), kinds["param_dtype"])) if c.norm.layer_scale else None
    return per_layer, scale


def _moe_options(moe: MoeConfig) -> dict:
    """The `MoE` keyword arguments that the moe sub-config names alike: all its fields but the
    experts' width, the dispatch (MoE's `implementation`) and which layers have experts."""
    options = dataclasses.asdict(moe)
    for name in ("d_ff", "dispatch", "every", "first_dense"):
        del options[name]
    return options


def _position(config: TransformerConfig, layer_type: str, rngs: nnx.Rngs) -> Position | None:
    """The positional encoding of a layer's self-attention (None: the embeddings carry
    positions, T5's stack adds its bias, or there are none)."""
    c = config
    if c.position == "rope":
        rope = dict(layout=c.rope.layout, rotary_fraction=c.rope.fraction)
        if layer_type == "sliding" and c.rope.local_theta is not None:
            return Rotary(theta=c.rope.local_theta, **rope)
        return Rotary(theta=c.rope.theta, scaling=c.rope.scaling, **rope)
    if c.position == "alibi":
        return ALiBi(c.num_heads)
    if c.position == "xl":
        head_dim = c.attention.head_dim or c.d_model // c.num_heads
        scale = head_dim**-0.5 if c.attention.scale is None else c.attention.scale
        return TransformerXL(c.d_model, c.num_heads, head_dim, scale=scale, rngs=rngs,
                             **dtypes(c))
    return None
