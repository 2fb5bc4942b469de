"""Shardings of a whole train state and of input batches, and placing trees and new models on
them.

The optimiser state follows the parameters: any leaf of the state whose path ends with a
parameter's path and has its shape (AdamW's mu and nu, "opt_state/0/mu/stack/.../kernel")
gets that parameter's sharding, so FSDP splits the parameters *and* the optimiser state.
Everything else (step, rng, optimiser counts) is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tfx.parallel.mesh import resolve_mesh
from tfx.parallel.rules import DEFAULT_RULES, param_specs

__all__ = ["BATCH_AXES", "batch_sharding", "check_mesh_use", "init_sharded", "shard",
           "state_shardings", "state_specs"]

# The mesh axes whose devices read different rows of the batch.
BATCH_AXES = ("data", "fsdp", "expert")

# The mesh axes that are there to split parameters, and why one that splits none is refused:
# "tensor" devices would all compute the same thing, and "expert" would only split the batch,
# which is what "data" is for.
_PARAMETER_AXES = {
    "expert": "the model has no mixture-of-experts layer (or its number of experts is not a "
              "multiple of {size}), so the axis would only split the batch: leave mesh.expert "
              "at 1 and use mesh.data for data parallelism",
    "tensor": "no weight of the model has an attention (heads x head_dim), MLP or vocabulary "
              "dimension divisible by {size}, so every device of the axis would compute the "
              "same thing: pick a size that divides one of them, or leave mesh.tensor at 1",
}


def state_specs(state, mesh, rules: Mapping = DEFAULT_RULES):
    """A tree like `state` of PartitionSpecs. `state` (arrays or ShapeDtypeStructs) is either

    - a train state: a TrainState, or any object with a `.params` field and optionally
      `.frozen` ones. Params (and frozen weights) are split by `param_specs`, leaves
      mirroring a parameter (same path suffix and shape: the optimiser's moments) like it, the
      rest replicated;
    - or the variables themselves: an nnx.State (`nnx.state(model)`, the params of
      `tfx.models.pure`) or any pytree of nnx Variables, split by `param_specs`.

    `mesh`: a Mesh or AbstractMesh."""
    if isinstance(state, Mapping) or not hasattr(state, "params"):
        return param_specs(state, mesh, rules)
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


def check_mesh_use(shardings, mesh) -> None:
    """Refuse a mesh whose "expert" or "tensor" axis has devices (size > 1) but splits no
    parameter, before anything is compiled: such an axis does nothing that the user asked for.

    Args:
      shardings: a model's parameters' or train state's NamedShardings or PartitionSpecs (a
        tree, as `state_shardings` / `state_specs` give them).
      mesh: the Mesh or AbstractMesh they are on.
    Raises:
      ValueError: naming the axis (mesh.expert, mesh.tensor), its size and why it is idle.
    """
    used = set()
    for leaf in jax.tree.leaves(shardings):
        for entry in getattr(leaf, "spec", leaf):
            used.update(entry if isinstance(entry, tuple) else (entry,))
    for axis, why in _PARAMETER_AXES.items():
        size = dict(mesh.shape).get(axis, 1)
        if size > 1 and axis not in used:
            raise ValueError(f"mesh.{axis}={size} splits no parameter: "
                             f"{why.format(size=size)}")


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


def init_sharded(build: Callable[..., nnx.Module], *args, mesh: Mesh | None = None,
                 rules: Mapping = DEFAULT_RULES) -> nnx.Module:
    """`build(*args)`, a function that makes an nnx module, with every variable made where
    `state_shardings` puts it on `mesh`: parameters split by their logical axes and `rules`,
    the rest replicated.

    >>> model = init_sharded(lambda rngs: Decoder(config, rngs=rngs), nnx.Rngs(0), mesh=mesh)

    The module is built inside one compiled program whose outputs have those shardings, so
    each device computes only its own pieces of the initial values (jax's random numbers are
    partitionable): no device ever holds a whole parameter that the mesh splits. The values are
    those of `build(*args)` run outside it, up to float rounding (compiled, not op by op).

    Args:
      build: makes the module; called (traced) once.
      *args: its arguments (an nnx.Rngs among them is advanced as `build` uses it).
      mesh: a jax Mesh; None: the mesh of an enclosing `jax.set_mesh` (also when called
        inside `jax.jit` or `jax.eval_shape`), and without one `build(*args)` itself (on the
        default device).
      rules: logical axis -> mesh axes (`DEFAULT_RULES`).
    Raises:
      TypeError: `mesh` is not a jax Mesh.
    """
    # The mesh of jax.set_mesh as an AbstractMesh, which (unlike jax.sharding.get_mesh) can
    # be read inside a trace too (`jax.jit`, `jax.eval_shape`); empty outside jax.set_mesh.
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else resolve_mesh(mesh)
    if mesh.empty:
        return build(*args)

    @nnx.jit
    def init(*args):
        model = build(*args)
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(
            state, state_shardings(state, mesh, rules)))
        return model

    return init(*args)
