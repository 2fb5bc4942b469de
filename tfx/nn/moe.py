"""Mixture-of-experts feed-forward block: a router and E expert MLPs, calling tfx.ops.moe.

Under a mesh (`jax.set_mesh`, or the `mesh` of tfx.train's steps) with an "expert" axis of
size > 1, the experts run expert-parallel (`tfx.ops.moe.expert_parallel_moe`): each device
routes its own tokens, so capacity and the load-balancing loss are per device's group of tokens.

The block records its routing losses in `nnx.Intermediate` variables on every call in train
mode (`model.train()`); `tfx.models.moe_losses` collects them after a forward pass. In eval
mode nothing is recorded and routing is deterministic (no jitter, GShard keeps every second
choice), so an eval-mode model can be closed over by plain `jax.jit`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn import axes
from tfx.nn.linear import flat_linear
from tfx.nn.mlp import MLP
from tfx.ops import moe

__all__ = ["Experts", "MoE"]


class Experts(nnx.Module):
    """E expert MLPs stacked: `gate` (gated only) and `up` [E, d_model, d_ff], `down`
    [E, d_ff, d_model], each initialised like an nnx.Linear kernel (LeCun normal per expert);
    with `bias` (GPT-OSS) also `gate_bias` (gated only), `up_bias` [E, d_ff] and `down_bias`
    [E, d_model], zeros like an nnx.Linear bias."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int, *, gated: bool,
                 bias: bool = False, param_dtype=jnp.float32, rngs: nnx.Rngs):
        init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=-2, out_axis=-1, batch_axis=(0,))

        def param(features_in, features_out, feature_axes):
            shape = (num_experts, features_in, features_out)
            return nnx.Param(init(rngs.params(), shape, param_dtype),
                             **axes.metadata(axes.EXPERT, *feature_axes))

        def bias_param(features, feature_axis, present=True):
            # Biases over d_model are replicated, as an nnx.Linear's (tfx.nn.axes).
            return (nnx.Param(jnp.zeros((num_experts, features), param_dtype),
                              **axes.metadata(axes.EXPERT, feature_axis))
                    if bias and present else None)

        self.gate = param(d_model, d_ff, (axes.EMBED, axes.MLP)) if gated else None
        self.up = param(d_model, d_ff, (axes.EMBED, axes.MLP))
        self.down = param(d_ff, d_model, (axes.MLP, axes.EMBED))
        self.gate_bias = bias_param(d_ff, axes.MLP, gated)
        self.up_bias = bias_param(d_ff, axes.MLP)
        self.down_bias = bias_param(d_model, None)

    def weights(self) -> moe.ExpertWeights:
        def value(param):
            return None if param is None else param[...]

        return moe.ExpertWeights(gate=value(self.gate), up=self.up[...], down=self.down[...],
                                 gate_bias=value(self.gate_bias), up_bias=value(self.up_bias),
                                 down_bias=value(self.down_bias))


class MoE(nnx.Module):
    """Route each token to `experts_per_token` of `num_experts` MLPs and sum their outputs,
    weighted by the router (see `tfx.ops.moe.route` for the policies, capacity and losses).

    Args:
      d_model: model width.
      d_ff: each expert's hidden width.
      num_experts: E, the number of experts.
      experts_per_token: k, the experts each token is sent to.
      activation: the experts' activation (gated silu = SwiGLU, as Mixtral).
      gated: the experts' gated MLP form, as in `MLP`.
      capacity_factor: None for dropless routing.
      policy: "topk", "gshard" or "deepseek"; with "deepseek" the block holds a
        `selection_bias` [E] (a Param that tfx.train moves toward balance instead of
        training it; a checkpoint's e_score_correction_bias) and records its `expert_load`
        [E] in train mode.
      jitter: Switch's router noise in training.
      implementation: the dispatch of tfx.ops.moe.experts_ffn: None (the platform's), "sorted",
        "onehot", "ragged" or "megablox".
      shared_experts: that many always-active experts (one MLP of width shared · d_ff) whose
        output is added to the routed experts' (DeepSeek).
      shared_gate: scale the shared experts' output per token by sigmoid(x · w), `shared_gate`
        a [d_model, 1] projection (Qwen3-Next, Qwen3.5's shared_expert_gate); needs
        shared_experts.
      renormalize: divide each token's k weights by their sum; None: when k > 1
        (transformers' norm_topk_prob).
      num_groups: DeepSeek-V3's group-limited routing ("deepseek"): each token's experts
        come from its groups_per_token best of num_groups groups.
      groups_per_token: see num_groups.
      routed_scale: factor of the routed experts' weights (routed_scaling_factor).
      router_bias: a bias on the router's logits (GPT-OSS).
      expert_bias: biases on the routed experts' projections (GPT-OSS; `Experts`).
      swiglu_limit: the routed experts' SwiGLU clamped at this limit, with sigmoid gain
        `swiglu_alpha` (GPT-OSS: `tfx.ops.moe.ClampedSwiGLU`; gated "silu" experts only);
        None: the plain gated activation.
      swiglu_alpha: see swiglu_limit.
      dtype: compute dtype of the experts (the router always computes in float32).
    """

    def __init__(self, d_model: int, d_ff: int, *, num_experts: int, experts_per_token: int,
                 activation: str = "silu", gated: bool = True,
                 capacity_factor: float | None = None, policy: str = "topk",
                 jitter: float = 0.0, implementation: str | None = None,
                 shared_experts: int = 0, shared_gate: bool = False,
                 renormalize: bool | None = None,
                 num_groups: int = 1, groups_per_token: int = 1, routed_scale: float = 1.0,
                 router_bias: bool = False, expert_bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.702,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        routing = dict(policy=policy, capacity_factor=capacity_factor, jitter=jitter,
                       num_groups=num_groups, groups_per_token=groups_per_token,
                       routed_scale=routed_scale)
        # A bad option fails here, naming it, rather than at the first call.
        moe.check_routing_options(num_experts, experts_per_token, **routing)
        _check_expert_form(activation, gated, shared_experts, expert_bias, swiglu_limit)
        if shared_gate and not shared_experts:
            raise ValueError("shared_gate scales the shared experts' output: it needs "
                             f"shared_experts >= 1, got {shared_experts}")
        # Replicated: every device routes its own tokens over all experts.
        self.router = flat_linear(d_model, num_experts, use_bias=router_bias,
                                  param_dtype=param_dtype, rngs=rngs,
                                  kernel_metadata=axes.metadata(None, None),
                                  bias_metadata=axes.metadata(None))
        self.experts = Experts(num_experts, d_model, d_ff, gated=gated, bias=expert_bias,
                               param_dtype=param_dtype, rngs=rngs)
        if swiglu_limit is not None:
            activation = moe.ClampedSwiGLU(swiglu_limit, swiglu_alpha)
        # The settings of tfx.ops.moe.moe, as a tuple: module attributes that are not arrays
        # must be hashable (they are part of the nnx graph definition).
        self.options = tuple(dict(num_selected=experts_per_token, renormalize=renormalize,
                                  activation=activation, implementation=implementation,
                                  **routing).items())
        self.shared = (MLP(d_model, shared_experts * d_ff, activation=activation, gated=gated,
                           use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                       if shared_experts else None)
        # One logit per token, replicated as the router is.
        self.shared_gate = (flat_linear(d_model, 1, use_bias=False, dtype=dtype,
                                        param_dtype=param_dtype, rngs=rngs,
                                        kernel_metadata=axes.metadata(None, None))
                            if shared_gate else None)
        deepseek = policy == "deepseek"
        self.selection_bias = (nnx.Param(jnp.zeros((num_experts,), jnp.float32)) if deepseek
                               else None)
        self.expert_load = (nnx.Intermediate(jnp.zeros((num_experts,), jnp.float32))
                            if deepseek else None)
        self.dtype = dtype
        random = jitter > 0 or policy == "gshard"
        self.rngs = rngs["router"].fork() if random else nnx.data(None)
        self.deterministic = False
        self.load_balancing_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))
        self.router_z_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))

    def __call__(self, x: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
        """[batch, seq, d_model] -> [batch, seq, d_model].

        token_mask: optional bool [batch, seq], False for padding: it routes nowhere (output
        zero, so the residual carries it), takes no capacity and counts in neither loss.
        """
        tokens = x.reshape(-1, x.shape[-1])
        if token_mask is not None:
            token_mask = token_mask.astype(bool).reshape(-1)
        if self.dtype is not None:
            tokens = tokens.astype(self.dtype)
        rng = None if self.deterministic or self.rngs is None else self.rngs()
        options = dict(self.options)
        if self.selection_bias is not None:
            options["selection_bias"] = self.selection_bias[...]
        if self.router.bias is not None:
            options["router_bias"] = self.router.bias[...]
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and mesh.shape.get("expert", 1) > 1:
            # The exchange (fixed or ragged, by platform) decides how each device runs its experts.
            del options["implementation"]
            out, routing = moe.expert_parallel_moe(tokens, self.router.kernel[...],
                                                   self.experts.weights(), mesh=mesh, rng=rng,
                                                   token_mask=token_mask, **options)
        else:
            out, routing = moe.moe(tokens, self.router.kernel[...], self.experts.weights(),
                                   rng=rng, token_mask=token_mask, **options)
        if not self.deterministic:
            self.load_balancing_loss.set_value(routing.load_balancing_loss)
            self.router_z_loss.set_value(routing.router_z_loss)
            if self.expert_load is not None:
                self.expert_load.set_value(moe.expert_load(routing, self.experts.up.shape[0]))
        out = out.reshape(x.shape)
        if self.shared is None:
            return out
        shared = self.shared(x)
        if self.shared_gate is not None:
            shared = shared * jax.nn.sigmoid(self.shared_gate(x)).astype(shared.dtype)
        return out + shared


def _check_expert_form(activation: str, gated: bool, shared_experts: int, expert_bias: bool,
                       swiglu_limit: float | None) -> None:
    """ValueError for an expert form the block cannot build: the clamped SwiGLU of experts that
    are not gated "silu" MLPs, or GPT-OSS's expert parts beside shared experts (a plain MLP,
    which has neither)."""
    if swiglu_limit is not None and not (gated and activation == "silu"):
        raise ValueError(f"swiglu_limit (the clamped SwiGLU) needs gated 'silu' experts, got "
                         f"gated={gated}, activation={activation!r}")
    extras = [name for name, on in (("expert_bias", expert_bias),
                                    ("swiglu_limit", swiglu_limit is not None)) if on]
    if shared_experts and extras:
        raise ValueError(f"{' and '.join(extras)} apply to the routed experts only: "
                         f"shared_experts={shared_experts} (a plain MLP) cannot have them")
