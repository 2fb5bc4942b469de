"""Expert parallelism: a mixture-of-experts layer whose experts are split over a mesh axis.

GShard's scheme with fixed-capacity buffers, in one `jax.shard_map`:
1. tokens are split over the batch axes of the mesh (a *group* per shard); every device routes
   its own group with `route`, so capacity, drops and the losses are per group;
2. each device writes its kept assignments into a send buffer [n, E_local, C, d_model]
   (n devices on the expert axis, E_local = E / n experts each, C slots per expert);
3. `all_to_all` over the expert axis hands every device the rows of its own experts from all
   n groups, [n, E_local, C, d_model], which it runs as E_local batches of n·C rows;
4. a second `all_to_all` sends the results back, and each device combines its tokens' rows.

Buffers have a fixed size, so only `all_to_all` is needed (`ragged_all_to_all` has no CPU
lowering). With a capacity the cost is E·C rows per group as in GShard; dropless routing sets
C = local tokens, so that no assignment can overflow, and every device then computes
E · local tokens rows for k · local tokens real ones: E / k times the work (and memory) of the
tokens themselves. Use a capacity factor for large E.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from tfx.ops import _checks
from tfx.ops.activations import ACTIVATIONS
from tfx.ops.moe.dispatch import ExpertWeights, batched_experts
from tfx.ops.moe.routing import Routing, expert_capacity, route

__all__ = ["expert_parallel_moe"]

BATCH_AXES = ("data", "fsdp", "expert")  # as tfx.parallel.sharding.BATCH_AXES (ops sit below)


@functools.partial(jax.jit, static_argnames=(
    "mesh", "expert_axis", "batch_axes", "num_selected", "policy", "capacity_factor", "jitter",
    "priority", "activation"))
def expert_parallel_moe(x: jax.Array, router_kernel: jax.Array, weights: ExpertWeights, *,
                        mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
                        expert_axis: str = "expert",
                        batch_axes: tuple[str, ...] = BATCH_AXES, num_selected: int,
                        policy: str = "topk", capacity_factor: float | None = None,
                        rng: jax.Array | None = None, jitter: float = 0.0,
                        priority: str = "position", token_mask: jax.Array | None = None,
                        activation: str = "silu") -> tuple[jax.Array, Routing]:
    """`tfx.ops.moe.moe` with the experts split over the mesh axis `expert_axis`.

    Args:
      x: [tokens, d_model], split over the axes of `batch_axes` that the mesh has with size
        > 1 (in that order); tokens must be divisible by the number of such shards (groups).
      router_kernel: [d_model, E], replicated.
      weights: ExpertWeights with leading dim E split over `expert_axis`; E must be divisible
        by its size.
      mesh: a Mesh or AbstractMesh (inside `jax.set_mesh`, `jax.sharding.get_abstract_mesh()`).
        Axes other than the batch and expert axes (e.g. "tensor") compute redundantly.
      num_selected, policy, capacity_factor, jitter, priority, token_mask ([tokens] bool,
        split like x): as in `route`, applied to each group's own tokens, so the capacity is
        ceil(cf · group tokens · k / E) per group.
      rng: folded with the group's index, so that the groups draw different noise.
      activation: a key of tfx.ops.activations.ACTIVATIONS.
    Returns:
      out [tokens, d_model] in x's dtype, split like x, and the Routing: its [tokens, k]
      fields split like x, `capacity` the per-group capacity, and the two losses the mean over
      the groups of each group's loss (not the loss of all tokens at once).
    """
    token_axes = _check(x, router_kernel, weights, mesh, expert_axis, batch_axes, activation,
                        token_mask)
    tokens = PartitionSpec(token_axes[0] if len(token_axes) == 1 else token_axes)
    experts = PartitionSpec(expert_axis)
    group_tokens = x.shape[0] // math.prod(mesh.shape[a] for a in token_axes)
    routing_specs = Routing(expert_ids=tokens, weights=tokens, kept=tokens, slot=tokens,
                            load_balancing_loss=PartitionSpec(), router_z_loss=PartitionSpec(),
                            capacity=expert_capacity(group_tokens, router_kernel.shape[1],
                                                     num_selected, capacity_factor))

    def local(x, router_kernel, weights, rng, token_mask):
        group = 0
        for axis in token_axes:  # row-major over the axes, as the PartitionSpec lays them out
            group = group * mesh.shape[axis] + jax.lax.axis_index(axis)
        logits = jnp.dot(x.astype(jnp.float32), router_kernel.astype(jnp.float32))
        routing = route(logits, num_selected=num_selected, policy=policy,
                        capacity_factor=capacity_factor,
                        rng=None if rng is None else jax.random.fold_in(rng, group),
                        jitter=jitter, priority=priority, token_mask=token_mask)
        out = _exchange_and_run(x, routing, weights, mesh.shape[expert_axis], expert_axis,
                                activation)
        losses = [jax.lax.pmean(loss, token_axes)
                  for loss in (routing.load_balancing_loss, routing.router_z_loss)]
        return out, Routing(expert_ids=routing.expert_ids, weights=routing.weights,
                            kept=routing.kept, slot=routing.slot,
                            load_balancing_loss=losses[0], router_z_loss=losses[1],
                            capacity=routing.capacity)

    out, routing = jax.shard_map(
        local, mesh=mesh, in_specs=(tokens, PartitionSpec(), experts, PartitionSpec(), tokens),
        out_specs=(tokens, routing_specs))(x, router_kernel, weights, rng, token_mask)
    return out, routing


def _exchange_and_run(x, routing: Routing, weights: ExpertWeights, devices: int,
                      expert_axis: str, activation: str):
    """One group's half of the exchange: x [T, d] -> out [T, d] with the local experts'
    weights [E_local, ...] and `devices` devices on the expert axis."""
    tokens, d_model = x.shape
    local_experts = weights.up.shape[0]
    experts = devices * local_experts
    capacity = tokens if routing.capacity is None else routing.capacity
    row = routing.expert_ids * capacity + routing.slot  # [T, k] into the [E·C] buffer
    send = _rows_to_buffer(x, row, routing.kept, experts * capacity)
    send = send.reshape(devices, local_experts, capacity, d_model)
    # [source group, E_local, C, d]: every group's rows for this device's experts.
    received = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=True)
    batch = received.transpose(1, 0, 2, 3).reshape(local_experts, devices * capacity, d_model)
    result = batched_experts(batch, weights, activation)
    result = result.reshape(local_experts, devices, capacity, d_model).transpose(1, 0, 2, 3)
    back = jax.lax.all_to_all(result, expert_axis, 0, 0, tiled=True)
    back = back.reshape(experts * capacity, d_model)
    gate = jnp.where(routing.kept, routing.weights, 0.0).astype(x.dtype)
    picked = jnp.take(back, jnp.where(routing.kept, row, 0), axis=0)
    return jnp.einsum("tk,tkd->td", gate, picked)


def _rows_to_buffer(x, row, kept, num_rows: int):
    """The [num_rows, d] buffer with x[t] at row[t, j] for each kept assignment, zeros
    elsewhere; a gather, so that its gradient is a scatter-add into x."""
    tokens, k = row.shape
    target = jnp.where(kept, row, num_rows).reshape(-1)
    source = jnp.full((num_rows,), tokens, jnp.int32).at[target].set(
        jnp.repeat(jnp.arange(tokens, dtype=jnp.int32), k), mode="drop")
    padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    return jnp.take(padded, source, axis=0)


def _check(x, router_kernel, weights: ExpertWeights, mesh, expert_axis, batch_axes, activation,
           token_mask) -> tuple[str, ...]:
    """Validate the arguments; returns the mesh axes that split the tokens."""
    _checks.floating("x", x, ndim=2, layout="[tokens, d_model]")
    _checks.floating("router_kernel", router_kernel, ndim=2, layout="[d_model, num_experts]")
    num_tokens, d_model = x.shape
    if router_kernel.shape[0] != d_model:
        raise ValueError(f"router_kernel must be [d_model={d_model}, num_experts], got shape "
                         f"{tuple(router_kernel.shape)}")
    num_experts = router_kernel.shape[1]
    _checks.rank("weights.up", weights.up, 3, "[num_experts, d_model, d_ff]")
    d_ff = weights.up.shape[2]
    expected = {"up": (num_experts, d_model, d_ff), "down": (num_experts, d_ff, d_model)}
    if weights.gate is not None:
        expected["gate"] = expected["up"]
    for name, shape in expected.items():
        if getattr(weights, name).shape != shape:
            raise ValueError(f"weights.{name} must have shape {shape} (num_experts from "
                             f"router_kernel, d_model from x, d_ff from weights.up), got "
                             f"{tuple(getattr(weights, name).shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if expert_axis not in mesh.shape:
        raise ValueError(f"expert_axis {expert_axis!r} is not an axis of mesh "
                         f"{tuple(mesh.shape)}")
    if num_experts % mesh.shape[expert_axis]:
        raise ValueError(f"num_experts ({num_experts}, router_kernel's last dim) must be "
                         f"divisible by the size of mesh axis expert_axis={expert_axis!r} "
                         f"({mesh.shape[expert_axis]})")
    if isinstance(batch_axes, str) or expert_axis not in batch_axes:
        raise ValueError(f"batch_axes must be a tuple of mesh axis names that includes "
                         f"expert_axis={expert_axis!r} (the tokens are split over the expert "
                         f"axis too, as in GShard), got {batch_axes!r}")
    # The expert axis stays in the spec even at size 1: the exchange makes values vary over it.
    token_axes = tuple(a for a in batch_axes
                       if a == expert_axis or mesh.shape.get(a, 1) > 1)
    groups = math.prod(mesh.shape[a] for a in token_axes)
    if num_tokens % groups:
        split = " x ".join(f"{a}={mesh.shape[a]}" for a in token_axes)
        raise ValueError(f"x's tokens ({num_tokens}) must be divisible by the {groups} batch "
                         f"shards ({split}) of batch_axes")
    if token_mask is not None:
        _checks.boolean("token_mask", token_mask)
        if token_mask.shape != (num_tokens,):
            raise ValueError(f"token_mask must be bool [tokens] = ({num_tokens},), got shape "
                             f"{tuple(token_mask.shape)}")
    return token_axes
