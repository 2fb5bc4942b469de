"""Shardings of a whole train state and of input batches, and placing trees on them.

The optimiser state follows the parameters: any leaf of the state whose path ends with a
parameter's path and has its shape (AdamW's mu and nu, "opt_state/0/mu/stack/.../kernel")
gets that parameter's sharding, so FSDP splits the parameters *and* the optimiser state.
Everything else (step, rng, optimiser counts) is replicated.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tfx.parallel.rules import DEFAULT_RULES, param_specs

__all__ = ["BATCH_AXES", "batch_sharding", "shard", "state_shardings", "state_specs"]

# The mesh axes whose devices read different rows of the batch.
BATCH_AXES = ("data", "fsdp", "expert")


def state_specs(state, mesh, rules: Mapping = DEFAULT_RULES):
    """A tree like `state` (a TrainState or any pytree with a `.params` field, and optionally
    `.frozen` ones; arrays or ShapeDtypeStructs) of PartitionSpecs: params (and frozen
    weights) by `param_specs`, leaves mirroring a
    parameter (same path suffix and shape) like it, the rest replicated. `mesh`: a Mesh or
    AbstractMesh."""
    by_path = {}
    for params in (state.params, getattr(state, "frozen", None)):  # frozen: PEFT fine-tuning
        if params is not None:
            by_path.update({
                tuple(path): (tuple(leaf.shape), spec)
                for (path, leaf), spec in zip(jax.tree.leaves_with_path(params),
                                              jax.tree.leaves(param_specs(params, mesh, rules)),
                                              strict=True)})

    def follow(path, leaf):
        for start in range(len(path)):
            shape, spec = by_path.get(tuple(path[start:]), (None, None))
            if shape == tuple(leaf.shape):
                return spec
        return PartitionSpec()

    return jax.tree.map_with_path(follow, state)


def state_shardings(state, mesh: Mesh, rules: Mapping = DEFAULT_RULES):
    """`state_specs` as NamedShardings on `mesh`: the `state_sharding` argument of
    `tfx.train.step.make_train_step`, and the target of `shard`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(state, mesh, rules))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows (the leading [batch] axis) split over the mesh axes data, fsdp and expert; other
    dims whole. The batch size must be a multiple of their sizes' product."""
    axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    if not axes:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(axes[0] if len(axes) == 1 else axes))


def shard(tree, shardings):
    """Place `tree` (arrays, identical in every process) on `shardings` (a matching tree, or
    one sharding for all). Each process transfers only the pieces its own devices hold."""
    return jax.device_put(tree, shardings)
