"""Which mesh axes each parameter is split over, in MaxText's two steps but small:

1. Every parameter names the *logical* axis of each of its dimensions where it is made
   (`tfx.nn.axes.metadata`, e.g. an attention query kernel ("embed", "heads")); layers
   stacked by `nnx.vmap` (`scan_layers=True`) get a leading "layers". A parameter that names
   no axes (norm scales, biases over d_model, relative-position tables, PEFT parameters) is
   replicated.
2. `rules` map logical axes to mesh axes (`DEFAULT_RULES`), here and nowhere else.

The defaults give Megatron tensor parallelism — query/key/value and MLP up/gate split their
output dimension over "tensor", the attention output and MLP down projections their input
dimension, so each layer needs one all-reduce forward — and FSDP: the other (d_model)
dimension of every matrix over "fsdp". Biases over heads or the MLP hidden width follow their
dimension. Mixture-of-experts weights [E, ...] split their experts over "expert" (expert
parallelism, tfx.ops.moe.expert_parallel_moe) and their other dims like the dense MLP's; the
router [d_model, E] is replicated (every device routes its own tokens over all experts).

A dimension stays replicated when its size is not divisible by the product of its mesh axes'
sizes (e.g. BERT's vocabulary of 30522 over tensor=4), and a mesh axis splits at most one
dimension of a parameter. Splitting q/k/v inside a head (num_kv_heads not a multiple of
"tensor") is still correct — the partitioner moves data as needed — only slower.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from tfx.nn.axes import KEY, LAYERS
from tfx.nn.paths import path_name

__all__ = ["DEFAULT_RULES", "logical_axes", "param_specs", "spec_for"]

# Logical axis -> mesh axis, tuple of mesh axes, or None (replicated). A logical axis missing
# from the rules is replicated.
DEFAULT_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",
    "layers": None,
}


def spec_for(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh_shape: Mapping[str, int],
             rules: Mapping = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims have logical `axes`. Mesh axes of size
    1 are left out (the spec names only axes that really split), as are trailing Nones."""
    used, spec = set(), []
    for size, logical in zip(shape, axes, strict=True):
        mesh_axes = rules.get(logical) if logical is not None else None
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        for axis in mesh_axes:
            if axis not in mesh_shape:
                raise ValueError(f"rules map {logical!r} to mesh axis {axis!r}, which is not "
                                 f"one of the mesh's axes {tuple(mesh_shape)}")
        mesh_axes = tuple(a for a in mesh_axes if mesh_shape[a] > 1 and a not in used)
        if mesh_axes and size % math.prod(mesh_shape[a] for a in mesh_axes) == 0:
            spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
            used.update(mesh_axes)
        else:
            spec.append(None)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def logical_axes(param: nnx.Variable, name: str = "parameter") -> tuple[str | None, ...]:
    """The logical axis of each dimension of `param` as declared where it was made
    (`tfx.nn.axes.metadata`); all None (replicated) when it declares none. `name`, its path,
    goes into the error raised when the names do not match its dimensions."""
    names = tuple(param.get_metadata(KEY, None) or ())
    if not names:
        return (None,) * len(param.shape)
    if len(names) != len(param.shape):
        # Fewer names than dims: most likely layers stacked without naming their axis.
        hint = ("" if len(names) > len(param.shape) else "; layers stacked by nnx.vmap need "
                f"transform_metadata={{nnx.PARTITION_NAME: {LAYERS!r}}}")
        raise ValueError(f"{name}: its metadata names {len(names)} axes {names} for a "
                         f"parameter of shape {tuple(param.shape)}{hint}")
    return names


def param_specs(params, mesh, rules: Mapping = DEFAULT_RULES):
    """A tree like `params` (the nnx.Param state, values arrays or ShapeDtypeStructs) of
    PartitionSpecs, each from the parameter's declared logical axes and its shape; leaves that
    are not nnx Variables (no metadata) are replicated. `mesh`: a Mesh or AbstractMesh (only
    its axis sizes are read)."""
    mesh_shape = dict(mesh.shape)

    def spec(path, leaf):
        if not isinstance(leaf, nnx.Variable):
            return PartitionSpec()
        names = logical_axes(leaf, path_name(path))
        return leaf.replace(spec_for(leaf.shape, names, mesh_shape, rules))

    return jax.tree.map_with_path(spec, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
