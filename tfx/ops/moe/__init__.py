"""Mixture of experts as pure functions: `route` tokens to experts, run `experts_ffn` on them,
or both at once with `moe`."""

from __future__ import annotations

import functools

import jax

from tfx.ops import _checks
from tfx.ops.backends import select_expert_all_to_all, select_grouped_matmul
from tfx.ops.moe.dispatch import (
    IMPLEMENTATIONS,
    ClampedSwiGLU,
    ExpertWeights,
    batched_experts,
    experts_ffn,
)
from tfx.ops.moe.expert_parallel import expert_parallel_moe
from tfx.ops.moe.grouped_matmul import grouped_matmul
from tfx.ops.moe.routing import (
    POLICIES,
    PRIORITIES,
    Routing,
    check_routing_options,
    expert_capacity,
    expert_load,
    route,
    router_logits,
    update_selection_bias,
)

__all__ = ["IMPLEMENTATIONS", "POLICIES", "PRIORITIES", "ClampedSwiGLU", "ExpertWeights",
           "Routing", "batched_experts", "check_routing_options", "expert_capacity", "expert_load",
           "expert_parallel_moe", "experts_ffn", "grouped_matmul", "moe", "route",
           "router_logits", "select_expert_all_to_all", "select_grouped_matmul",
           "update_selection_bias"]


@functools.partial(jax.jit, static_argnames=(
    "num_selected", "policy", "capacity_factor", "jitter", "priority", "renormalize",
    "num_groups", "groups_per_token", "routed_scale", "activation", "implementation",
    "block_size", "interpret"))
def moe(x: jax.Array, router_kernel: jax.Array, weights: ExpertWeights, *, num_selected: int,
        router_bias: jax.Array | None = None, policy: str = "topk",
        capacity_factor: float | None = None, rng: jax.Array | None = None,
        jitter: float = 0.0, priority: str = "position", token_mask: jax.Array | None = None,
        selection_bias: jax.Array | None = None, renormalize: bool | None = None,
        num_groups: int = 1, groups_per_token: int = 1, routed_scale: float = 1.0,
        activation: str | ClampedSwiGLU = "silu", implementation: str | None = None,
        block_size: int = 128, interpret: bool = False) -> tuple[jax.Array, Routing]:
    """A mixture-of-experts MLP: route x [tokens, d_model] with router_kernel [d_model, E]
    (and router_bias [E], GPT-OSS's), run the experts and combine. Returns ([tokens,
    d_model], the Routing with its losses). Arguments as in `route` (renormalize, num_groups,
    groups_per_token and routed_scale for Qwen3-MoE's and DeepSeek-V3's routers) and
    `experts_ffn`."""
    _checks.floating("x", x, ndim=2, layout="[tokens, d_model]")
    routing = route(router_logits(x, router_kernel, router_bias), num_selected=num_selected,
                    policy=policy, capacity_factor=capacity_factor, rng=rng, jitter=jitter,
                    priority=priority,
                    token_mask=token_mask, selection_bias=selection_bias,
                    renormalize=renormalize, num_groups=num_groups,
                    groups_per_token=groups_per_token, routed_scale=routed_scale)
    out = experts_ffn(x, routing, weights, activation=activation,
                      implementation=implementation, block_size=block_size,
                      interpret=interpret)
    return out, routing
