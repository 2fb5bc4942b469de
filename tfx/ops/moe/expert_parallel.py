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

import dataclasses
import functools
import math

import jax
from jax.sharding import PartitionSpec

from tfx.ops import _checks
from tfx.ops.activations import ACTIVATIONS
from tfx.ops.moe.dispatch import (
    ExpertWeights,
    batched_experts,
    check_weights,
    combine_rows,
    gather_rows,
)
from tfx.ops.moe.routing import (
    Routing,
    check_router_kernel,
    expert_capacity,
    route,
    router_logits,
)

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
                        selection_bias: jax.Array | None = None,
                        activation: str = "silu") -> tuple[jax.Array, Routing]:
    """`tfx.ops.moe.moe` with the experts split over the mesh axis `expert_axis`.

    Args:
      x: [tokens, d_model], split over the axes of `batch_axes` that the mesh has with size
        > 1, in that order, and always over `expert_axis` (which `batch_axes` must include,
        as GShard splits the batch over the expert devices too). tokens must be divisible by
        the number of shards; each shard's tokens are a *group*.
      router_kernel: [d_model, E], replicated.
      weights: ExpertWeights with leading dim E split over `expert_axis`; E must be divisible
        by its size.
      mesh: a Mesh or AbstractMesh (inside `jax.set_mesh`, `jax.sharding.get_abstract_mesh()`).
        Axes other than the batch and expert axes (e.g. "tensor") compute redundantly.
      num_selected, policy, capacity_factor, jitter, priority, selection_bias (replicated),
        token_mask ([tokens] bool, split like x): as in `route`, applied to each group's own
        tokens, so the capacity is ceil(cf · group tokens · k / E) per group.
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

    def local(x, router_kernel, weights, rng, token_mask, selection_bias):
        group = 0
        for axis in token_axes:  # row-major over the axes, as the PartitionSpec lays them out
            group = group * mesh.shape[axis] + jax.lax.axis_index(axis)
        routing = route(router_logits(x, router_kernel), num_selected=num_selected, policy=policy,
                        capacity_factor=capacity_factor,
                        rng=None if rng is None else jax.random.fold_in(rng, group),
                        jitter=jitter, priority=priority, token_mask=token_mask,
                        selection_bias=selection_bias)
        out = _exchange_and_run(x, routing, weights, mesh.shape[expert_axis], expert_axis,
                                activation)
        return out, dataclasses.replace(
            routing, load_balancing_loss=jax.lax.pmean(routing.load_balancing_loss, token_axes),
            router_z_loss=jax.lax.pmean(routing.router_z_loss, token_axes))

    out, routing = jax.shard_map(
        local, mesh=mesh,
        in_specs=(tokens, PartitionSpec(), experts, PartitionSpec(), tokens, PartitionSpec()),
        out_specs=(tokens, routing_specs))(x, router_kernel, weights, rng, token_mask,
                                           selection_bias)
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
    send = gather_rows(x, row, routing.kept, experts * capacity)
    send = send.reshape(devices, local_experts, capacity, d_model)
    # [source group, E_local, C, d]: every group's rows for this device's experts.
    received = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=True)
    batch = received.transpose(1, 0, 2, 3).reshape(local_experts, devices * capacity, d_model)
    result = batched_experts(batch, weights, activation)
    result = result.reshape(local_experts, devices, capacity, d_model).transpose(1, 0, 2, 3)
    back = jax.lax.all_to_all(result, expert_axis, 0, 0, tiled=True)
    return combine_rows(back.reshape(experts * capacity, d_model), row, routing, x.dtype)


def _check(x, router_kernel, weights: ExpertWeights, mesh, expert_axis, batch_axes, activation,
           token_mask) -> tuple[str, ...]:
    """Validate the arguments; returns the mesh axes that split the tokens."""
    _checks.floating("x", x, ndim=2, layout="[tokens, d_model]")
    num_tokens, d_model = x.shape
    check_router_kernel(router_kernel, d_model)
    num_experts = router_kernel.shape[1]
    check_weights(weights, d_model, num_experts)
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
