"""What a train step does for a model with experts: the routing losses join the loss, and
DeepSeek-style selection biases move toward balance (they are not trained by the optimiser)."""

from __future__ import annotations

import jax
from flax import nnx

from tfx.models import aux_loss, moe_losses
from tfx.nn.moe import MoE
from tfx.nn.paths import path_name
from tfx.ops.moe import update_selection_bias

__all__ = ["MOE_METRICS", "add_moe_losses", "balance_experts", "expert_loads"]

# Training metrics of models with experts (means over MoE layers, tfx.models.moe_losses).
MOE_METRICS = ("load_balancing_loss", "router_z_loss")


def add_moe_losses(model: nnx.Module, total, count, metrics: dict, *,
                   load_balancing_weight: float, router_z_weight: float):
    """Add the routing losses, weighted so, once per target (so that the mean over targets is
    cross-entropy + aux) and their values as metric sums; no-op without experts."""
    if model.config.moe is None:
        return total, metrics
    losses = moe_losses(model)
    metrics = {**metrics, **{name: value * count for name, value in losses.items()}}
    aux = aux_loss(model, load_balancing_weight=load_balancing_weight,
                   router_z_weight=router_z_weight)
    return total + count * aux, metrics


def expert_loads(model: nnx.Module) -> dict[str, jax.Array]:
    """{parameter path of each selection bias: the expert load its layer recorded in this
    forward pass ([E], or [layers, E] when stacked)}; empty unless moe.policy="deepseek"."""
    return {path_name((*path, "selection_bias")): module.expert_load[...]
            for path, module in nnx.iter_graph(model)
            if isinstance(module, MoE) and module.selection_bias is not None}


def balance_experts(old_params, new_params, loads: dict, rate: float):
    """new_params with every selection bias replaced by its pre-step value moved by ±rate
    toward balance (`tfx.ops.moe.update_selection_bias`), whatever the optimiser did to it.
    loads: from `expert_loads`, summed over micro-batches (only their signs matter)."""
    def pick(path, old, new):
        name = path_name(path)
        return update_selection_bias(old, loads[name], rate) if name in loads else new

    return jax.tree.map_with_path(pick, old_params, new_params)
