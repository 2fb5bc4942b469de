"""The feed-forward block (`MlpConfig`) and a mixture of experts in place of some layers' MLP
(`MoeConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from tfx import names
from tfx.models.parts._checks import boolean, one_of, positive_int

__all__ = ["Activation", "MlpConfig", "MoeConfig", "MoeDispatch", "MoePolicy"]

# The names come from tfx.names (one source, jax-free), as tyro and the CLI read them.
Activation = Literal[names.ACTIVATIONS]
MoePolicy = Literal[names.MOE_POLICIES]
MoeDispatch = Literal[names.MOE_DISPATCHES]
# GPT-OSS's gain of its clamped SwiGLU (MoeConfig.swiglu_alpha), the default.
_SWIGLU_ALPHA = 1.702


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpConfig:
    """The feed-forward block (and the experts of a mixture)."""

    activation: Activation = "gelu"
    """Nonlinearity (`tfx.ops.activations.ACTIVATIONS`)."""
    gated: bool = False
    """A gated linear unit (SwiGLU with activation="silu")."""
    parallel: bool = False
    """The MLP reads the layer's input beside attention, x + attention(n1(x)) + mlp(n2(x))
    (GPT-NeoX, GPT-J), instead of the attention's output; pre-norm models only."""
    wide_shared: bool = False
    """The layers that attend another's keys (attention.shared_kv_layers) have MLPs of twice
    d_ff (Gemma 4's use_double_wide_mlp); False: every MLP has d_ff."""

    def __post_init__(self):
        one_of("mlp.activation", self.activation, get_args(Activation))
        boolean("mlp.gated", self.gated)
        boolean("mlp.parallel", self.parallel)
        boolean("mlp.wide_shared", self.wide_shared)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """A mixture of experts (tfx.ops.moe) in place of some layers' MLP. Experts are MLPs with
    the model's activation and gating, without biases unless `expert_bias`. The training
    losses' weights and the "deepseek" bias rate are training settings
    (tfx.train.config.TrainConfig)."""

    num_experts: int = 8
    """Routed experts per layer."""
    experts_per_token: int = 2
    """Experts that each token goes to."""
    every: int = 1
    """Layer i (0-based) has experts when (i + 1) % every == 0."""
    d_ff: int | None = None
    """Width of an expert; None for the model's d_ff."""
    capacity_factor: float | None = None
    """Tokens an expert takes, as a multiple of its fair share; None: dropless."""
    policy: MoePolicy = "topk"
    """Router: top-k, GShard's top-2, or DeepSeek's bias-balanced top-k."""
    jitter: float = 0.0
    """Noise on the router logits in training."""
    dispatch: MoeDispatch | None = None
    """Implementation of `tfx.ops.moe.experts_ffn`; None for the platform's."""
    shared_experts: int = 0
    """Experts that every token uses beside the routed ones (DeepSeek)."""
    shared_gate: bool = False
    """The shared experts' output scaled per token by sigmoid(x · w), w a learned [d_model]
    vector (Qwen3-Next and Qwen3.5's shared_expert_gate); needs shared_experts."""
    first_dense: int = 0
    """The first layers keep a dense MLP of width d_ff (DeepSeek's first_k_dense_replace)."""
    renormalize: bool | None = None
    """Divide each token's k weights by their sum; None: when k > 1 (Mixtral), not at k = 1
    (Switch). Qwen 3 MoE's norm_topk_prob."""
    num_groups: int = 1
    """Experts form this many equal groups, of which a token may use `groups_per_token`
    (DeepSeek-V3's group-limited routing); 1: no groups."""
    groups_per_token: int = 1
    """Groups a token's experts may come from (DeepSeek-V3's topk_group)."""
    routed_scale: float = 1.0
    """Factor of the routed experts' weights (DeepSeek-V3's routed_scaling_factor)."""
    router_bias: bool = False
    """A bias on the router's logits (GPT-OSS)."""
    expert_bias: bool = False
    """Biases on each routed expert's gate, up and down projections (GPT-OSS)."""
    swiglu_limit: float | None = None
    """The routed experts' SwiGLU clamped as GPT-OSS's (`tfx.ops.moe.ClampedSwiGLU`; gated
    "silu" experts): g = min(gate, limit), u = clip(up, -limit, limit), hidden
    (u + 1) · g · sigmoid(swiglu_alpha · g); None: silu(gate) · up."""
    swiglu_alpha: float = _SWIGLU_ALPHA
    """Sigmoid gain of the clamped SwiGLU (GPT-OSS: 1.702, where g · sigmoid(1.702 g) ≈
    GELU); with swiglu_limit only."""

    def __post_init__(self):
        for name in ("num_experts", "experts_per_token", "every"):
            positive_int(f"moe.{name}", getattr(self, name))
        if self.d_ff is not None:
            positive_int("moe.d_ff", self.d_ff)
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"moe.experts_per_token ({self.experts_per_token}) must be <= "
                             f"moe.num_experts ({self.num_experts})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"moe.capacity_factor must be > 0 or None (dropless), got "
                             f"{self.capacity_factor}")
        one_of("moe.policy", self.policy, get_args(MoePolicy))
        if self.policy == "gshard" and self.experts_per_token != 2:
            raise ValueError("moe.policy 'gshard' routes to 2 experts: moe.experts_per_token "
                             f"must be 2, got {self.experts_per_token}")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"moe.jitter must be in [0, 1), got {self.jitter}")
        one_of("moe.dispatch", self.dispatch, (None, *get_args(MoeDispatch)))
        positive_int("moe.shared_experts", self.shared_experts, minimum=0)
        boolean("moe.shared_gate", self.shared_gate)
        if self.shared_gate and not self.shared_experts:
            raise ValueError("moe.shared_gate scales the shared experts' output: set "
                             f"moe.shared_experts >= 1, got {self.shared_experts}")
        positive_int("moe.first_dense", self.first_dense, minimum=0)
        if self.renormalize is not None:
            boolean("moe.renormalize", self.renormalize)
        boolean("moe.router_bias", self.router_bias)
        boolean("moe.expert_bias", self.expert_bias)
        self._check_groups()
        self._check_swiglu()

    def _check_swiglu(self):
        for name in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float)
                                          and not isinstance(value, bool)
                                          and 0 < value < float("inf")):
                raise ValueError(f"moe.{name} must be a finite number > 0, got {value!r}")
        if self.swiglu_limit is None and self.swiglu_alpha != _SWIGLU_ALPHA:
            raise ValueError(f"moe.swiglu_alpha ({self.swiglu_alpha}) is the gain of the clamped "
                             "SwiGLU: set moe.swiglu_limit too")

    def _check_groups(self):
        positive_int("moe.num_groups", self.num_groups)
        positive_int("moe.groups_per_token", self.groups_per_token)
        if self.num_experts % self.num_groups:
            raise ValueError(f"moe.num_groups ({self.num_groups}) must divide moe.num_experts "
                             f"({self.num_experts})")
        if self.num_groups > 1 and self.policy != "deepseek":
            raise ValueError(f"moe.num_groups > 1 (group-limited routing) needs moe.policy "
                             f"'deepseek', got {self.policy!r}")
        if self.groups_per_token > self.num_groups:
            raise ValueError(f"moe.groups_per_token ({self.groups_per_token}) must be <= "
                             f"moe.num_groups ({self.num_groups})")
        if self.experts_per_token > self.groups_per_token * self.num_experts // self.num_groups:
            raise ValueError(f"moe.experts_per_token ({self.experts_per_token}) must be <= the "
                             f"experts of moe.groups_per_token groups")
        if not (isinstance(self.routed_scale, int | float) and self.routed_scale > 0):
            raise ValueError(f"moe.routed_scale must be a number > 0, got {self.routed_scale!r}")
