"""The auxiliary losses of a model's mixture-of-experts layers, read after a forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn.moe import MoE

__all__ = ["aux_loss", "moe_losses"]


def moe_losses(model: nnx.Module) -> dict[str, jax.Array]:
    """{"load_balancing_loss", "router_z_loss"}: float32 scalars, each the mean over the
    model's MoE layers of what they recorded in their last train-mode call (stacked layers
    count one by one). A mean rather than a sum, so a loss weight means the same at any depth.
    Zeros for a model without MoE layers.
    """
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]
    out = {}
    for name in ("load_balancing_loss", "router_z_loss"):
        values = [getattr(m, name)[...].reshape(-1) for m in layers]
        out[name] = (jnp.concatenate(values).mean() if values
                     else jnp.zeros((), jnp.float32))
    return out


def aux_loss(model: nnx.Module, *, load_balancing_weight: float,
             router_z_weight: float) -> jax.Array:
    """load_balancing_weight · load_balancing_loss + router_z_weight · router_z_loss: the term
    a training objective adds to its loss (the weights are training settings,
    tfx.train.config.TrainConfig). float32 []."""
    losses = moe_losses(model)
    return (load_balancing_weight * losses["load_balancing_loss"]
            + router_z_weight * losses["router_z_loss"])
