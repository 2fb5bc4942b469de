"""Expert parallelism: a mixture-of-experts layer whose experts are split over a mesh axis.

Two exchanges, chosen by platform (tfx.ops.backends) or forced with `exchange=`.

"fixed" (any platform): GShard's scheme with fixed-capacity buffers, in one `jax.shard_map`:
1. tokens are split over the batch axes of the mesh (a *group* per shard); every device routes
   its own group with `route`, so capacity, drops and the losses are per group;
2. each device writes its kept assignments into a send buffer [n, E_local, C, d_model]
   (n devices on the expert axis, E_local = E / n experts each, C slots per expert);
3. `all_to_all` over the expert axis hands every device the rows of its own experts from all
   n groups, [n, E_local, C, d_model], which it runs as E_local batches of n·C rows;
4. a second `all_to_all` sends the results back, and each device combines its tokens' rows.

Buffers have a fixed size, so only `all_to_all` is needed. With a capacity the cost is E·C rows
per group as in GShard; dropless routing sets C = local tokens, so that no assignment can
overflow, and every device then computes E · local tokens rows for k · local tokens real ones:
E / k times the work (and memory) of the tokens themselves. Use a capacity factor for large E.

"ragged" (GPU, TPU: `jax.lax.ragged_all_to_all`, which XLA:CPU does not implement): steps 1
and 4 as above, but each device sends exactly its kept rows, sorted by expert:
2. the per-expert row counts go first (an `all_to_all` of [n, E_local] int32), from which every
   device computes the sizes and offsets of what it sends and receives (`ragged_plan`);
3. `ragged_all_to_all` delivers the rows, grouped by source and then by local expert, into a
   buffer of n · min(T·k, E_local·C) rows (what could arrive at most: T local tokens with k
   choices, or C per expert); the device sorts them by local expert, runs its experts as one
   grouped matmul over the received rows (`jax.lax.ragged_dot`, megablox on TPU), and a second
   `ragged_all_to_all` returns them to where they came from.
No capacity padding crosses the network and the matmuls see the routed rows only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from tfx.ops import _checks
from tfx.ops.backends import (
    current_platform,
    select_expert_all_to_all,
    select_grouped_matmul,
    supports_ragged_all_to_all,
)
from tfx.ops.moe.dispatch import (
    ClampedSwiGLU,
    ExpertWeights,
    batched_experts,
    check_activation,
    check_weights,
    combine_rows,
    gather_rows,
    grouped_experts,
    sorted_rows,
)
from tfx.ops.moe.routing import (
    Routing,
    check_router_kernel,
    expert_capacity,
    route,
    router_logits,
)

__all__ = ["EXCHANGES", "RaggedPlan", "expert_parallel_moe", "ragged_plan"]

EXCHANGES = ("fixed", "ragged")

BATCH_AXES = ("data", "fsdp", "expert")  # as tfx.parallel.sharding.BATCH_AXES (ops sit below)


@functools.partial(jax.jit, static_argnames=(
    "mesh", "expert_axis", "batch_axes", "num_selected", "policy", "capacity_factor", "jitter",
    "priority", "renormalize", "num_groups", "groups_per_token", "routed_scale", "activation",
    "exchange"))
def expert_parallel_moe(x: jax.Array, router_kernel: jax.Array, weights: ExpertWeights, *,
                        mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
                        expert_axis: str = "expert",
                        batch_axes: tuple[str, ...] = BATCH_AXES, num_selected: int,
                        router_bias: jax.Array | None = None, policy: str = "topk",
                        capacity_factor: float | None = None,
                        rng: jax.Array | None = None, jitter: float = 0.0,
                        priority: str = "position", token_mask: jax.Array | None = None,
                        selection_bias: jax.Array | None = None,
                        renormalize: bool | None = None, num_groups: int = 1,
                        groups_per_token: int = 1, routed_scale: float = 1.0,
                        activation: str | ClampedSwiGLU = "silu",
                        exchange: str | None = None) -> tuple[jax.Array, Routing]:
    """`tfx.ops.moe.moe` with the experts split over the mesh axis `expert_axis`.

    Args:
      x: [tokens, d_model], split over the axes of `batch_axes` that the mesh has with size
        > 1, in that order, and always over `expert_axis` (which `batch_axes` must include,
        as GShard splits the batch over the expert devices too). tokens must be divisible by
        the number of shards; each shard's tokens are a *group*.
      router_kernel: [d_model, E], replicated.
      weights: ExpertWeights (biases included) with leading dim E split over `expert_axis`; E
        must be divisible by its size.
      mesh: a Mesh or AbstractMesh (inside `jax.set_mesh`, `jax.sharding.get_abstract_mesh()`).
        Axes other than the batch and expert axes (e.g. "tensor") compute redundantly.
      num_selected: as in `route`.
      router_bias: [E] or None, as in `tfx.ops.moe.moe`; replicated.
      policy: as in `route`.
      capacity_factor: as in `route`, applied to each group's own tokens, so the capacity is
        ceil(cf · group tokens · k / E) per group.
      jitter: as in `route`.
      priority: as in `route`.
      selection_bias: as in `route`, replicated.
      renormalize: as in `route`.
      num_groups: as in `route` (each token's groups are its own, so they do not depend on
        the split).
      groups_per_token: as in `route`.
      routed_scale: as in `route`.
      token_mask: [tokens] bool, split like x; as in `route`.
      rng: folded with the group's index, so that the groups draw different noise.
      activation: as in `experts_ffn`.
      exchange: None (the platform's: "ragged" on GPU and TPU, else "fixed"), "fixed" or
        "ragged" (module docstring); "ragged" raises ValueError where XLA lacks
        `ragged_all_to_all`. Both give the same result.
    Returns:
      out [tokens, d_model] in x's dtype, split like x, and the Routing: its [tokens, k]
      fields split like x, `capacity` the per-group capacity, and the two losses the mean over
      the groups of each group's loss (not the loss of all tokens at once).
    """
    platform = current_platform()
    if exchange is None:
        exchange = select_expert_all_to_all(platform)
    token_axes = _check(x, router_kernel, router_bias, weights, mesh, expert_axis, batch_axes,
                        activation, token_mask, exchange, platform)
    run = (functools.partial(_exchange_ragged, matmul=_local_matmul(platform))
           if exchange == "ragged" else _exchange_fixed)
    tokens = PartitionSpec(token_axes[0] if len(token_axes) == 1 else token_axes)
    experts = PartitionSpec(expert_axis)
    group_tokens = x.shape[0] // math.prod(mesh.shape[a] for a in token_axes)
    routing_specs = Routing(expert_ids=tokens, weights=tokens, kept=tokens, slot=tokens,
                            load_balancing_loss=PartitionSpec(), router_z_loss=PartitionSpec(),
                            capacity=expert_capacity(group_tokens, router_kernel.shape[1],
                                                     num_selected, capacity_factor))

    def local(x, router_kernel, router_bias, weights, rng, token_mask, selection_bias):
        group = 0
        for axis in token_axes:  # row-major over the axes, as the PartitionSpec lays them out
            group = group * mesh.shape[axis] + jax.lax.axis_index(axis)
        routing = route(router_logits(x, router_kernel, router_bias), num_selected=num_selected,
                        policy=policy,
                        capacity_factor=capacity_factor,
                        rng=None if rng is None else jax.random.fold_in(rng, group),
                        jitter=jitter, priority=priority, token_mask=token_mask,
                        selection_bias=selection_bias, renormalize=renormalize,
                        num_groups=num_groups, groups_per_token=groups_per_token,
                        routed_scale=routed_scale)
        out = run(x, routing, weights, mesh.shape[expert_axis], expert_axis, activation)
        return out, dataclasses.replace(
            routing, load_balancing_loss=jax.lax.pmean(routing.load_balancing_loss, token_axes),
            router_z_loss=jax.lax.pmean(routing.router_z_loss, token_axes))

    out, routing = jax.shard_map(
        local, mesh=mesh,
        in_specs=(tokens, PartitionSpec(), PartitionSpec(), experts, PartitionSpec(), tokens,
                  PartitionSpec()),
        out_specs=(tokens, routing_specs))(x, router_kernel, router_bias, weights, rng,
                                           token_mask, selection_bias)
    return out, routing


def _exchange_fixed(x, routing: Routing, weights: ExpertWeights, devices: int,
                    expert_axis: str, activation):
    """One group's half of the fixed exchange: x [T, d] -> out [T, d] with the local experts'
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """One device's side of the ragged exchange, over n devices with E_local experts each:
    it sends send_sizes[j] rows from input_offsets[j] to device j, and receives recv_sizes[s]
    rows from device s at recv_offsets[s] (int32 [n] each); receive_expert int32 [rows] is the
    local expert of each received row (E_local for the unused rows at the end)."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    recv_offsets: jax.Array
    recv_sizes: jax.Array
    receive_expert: jax.Array


def ragged_plan(send_counts: jax.Array, recv_counts: jax.Array, num_rows: int) -> RaggedPlan:
    """The sizes and offsets of the ragged exchange from the row counts.

    Args:
      send_counts: int32 [n, E_local], this device's kept rows for expert e of device j (its
        rows are sorted by global expert j · E_local + e).
      recv_counts: int32 [n, E_local], the rows device s sends for this device's expert e (the
        `all_to_all` of every device's send_counts).
      num_rows: the static size of the receive buffer, at least recv_counts' sum.
    """
    send_sizes, recv_sizes = send_counts.sum(1), recv_counts.sum(1)
    # Rows arrive grouped by source, each source's sorted by local expert: run r of the flat
    # [n · E_local] counts is expert r % E_local.
    run_ends = jnp.cumsum(recv_counts.reshape(-1))
    run = jnp.searchsorted(run_ends, jnp.arange(num_rows, dtype=jnp.int32), side="right")
    local_experts = recv_counts.shape[1]
    receive_expert = jnp.where(run < run_ends.shape[0], run % local_experts, local_experts)
    return RaggedPlan(input_offsets=_starts(send_sizes), send_sizes=send_sizes,
                      recv_offsets=_starts(recv_sizes), recv_sizes=recv_sizes,
                      receive_expert=receive_expert.astype(jnp.int32))


def _starts(sizes):
    return (jnp.cumsum(sizes) - sizes).astype(jnp.int32)


def _local_matmul(platform: str) -> str:
    """The grouped matmul of the ragged exchange's local experts: megablox where it is the
    platform's kernel, else `ragged_dot` (the rows are not block-padded for "sorted")."""
    return "megablox" if select_grouped_matmul(platform) == "megablox" else "ragged"


def _exchange_ragged(x, routing: Routing, weights: ExpertWeights, devices: int,
                     expert_axis: str, activation, *, matmul: str):
    """One group's half of the ragged exchange (same contract as `_exchange_fixed`)."""
    tokens, d_model = x.shape
    assignments = routing.expert_ids.size
    local_experts = weights.up.shape[0]
    capacity = tokens if routing.capacity is None else routing.capacity
    rows, destination, counts = sorted_rows(x, routing, devices * local_experts, 1, assignments)
    send_counts = counts.reshape(devices, local_experts)
    recv_counts = jax.lax.all_to_all(send_counts, expert_axis, 0, 0, tiled=True)
    num_rows = devices * min(assignments, local_experts * capacity)
    plan = ragged_plan(send_counts, recv_counts, num_rows)
    # ragged_all_to_all wants, per destination, where the rows land there: its recv_offsets
    # entry for this device.
    landing = jax.lax.all_to_all(plan.recv_offsets, expert_axis, 0, 0, tiled=True)
    received = jax.lax.ragged_all_to_all(rows, jnp.zeros((num_rows, d_model), x.dtype),
                                         plan.input_offsets, plan.send_sizes, landing,
                                         plan.recv_sizes, axis_name=expert_axis)
    order = jnp.argsort(plan.receive_expert, stable=True)
    result = grouped_experts(received[order], recv_counts.sum(0), weights, activation, matmul)
    result = jnp.zeros_like(result).at[order].set(result, unique_indices=True)
    returning = jax.lax.all_to_all(plan.input_offsets, expert_axis, 0, 0, tiled=True)
    back = jax.lax.ragged_all_to_all(result, jnp.zeros_like(rows), plan.recv_offsets,
                                     plan.recv_sizes, returning, plan.send_sizes,
                                     axis_name=expert_axis)
    return combine_rows(back, destination, routing, x.dtype)


def _check(x, router_kernel, router_bias, weights: ExpertWeights, mesh, expert_axis,
           batch_axes, activation, token_mask, exchange, platform) -> tuple[str, ...]:
    """Validate the arguments; returns the mesh axes that split the tokens."""
    _checks.floating("x", x, ndim=2, layout="[tokens, d_model]")
    num_tokens, d_model = x.shape
    check_router_kernel(router_kernel, d_model, router_bias)
    num_experts = router_kernel.shape[1]
    check_weights(weights, d_model, num_experts)
    check_activation(activation, weights)
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be None or one of {EXCHANGES}, got {exchange!r}")
    if exchange == "ragged" and not supports_ragged_all_to_all(platform):
        raise ValueError(f"exchange='ragged' needs jax.lax.ragged_all_to_all, which XLA "
                         f"implements on GPU and TPU only; the platform is {platform!r} (use "
                         f"exchange=None or 'fixed')")
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
