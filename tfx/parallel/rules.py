"""Which mesh axes each parameter is split over, in MaxText's two steps but small:

1. `PARAM_AXES` names the *logical* axis of every dimension of a parameter, found by its path
   in the `nnx.split` state ("stack/layers/0/attention/query/kernel" -> ("embed", "heads")).
2. `rules` map logical axes to mesh axes (`DEFAULT_RULES`).

The defaults give Megatron tensor parallelism — query/key/value and MLP up/gate split their
output dimension over "tensor", the attention output and MLP down projections their input
dimension, so each layer needs one all-reduce forward — and FSDP: the other (d_model)
dimension of every matrix over "fsdp". Vectors (norm scales, biases over d_model) and small
tables (relative-position biases) stay replicated; biases over heads or the MLP hidden width
follow their dimension. Stacked layers (`scan_layers=True`) add a leading "layers" dimension.
Mixture-of-experts weights [E, ...] split their experts over "expert" (expert parallelism,
tfx.ops.moe.expert_parallel_moe) and their other dims like the dense MLP's; the router
[d_model, E] is replicated (every device routes its own tokens over all experts).

A dimension stays replicated when its size is not divisible by the product of its mesh axes'
sizes (e.g. BERT's vocabulary of 30522 over tensor=4), and a mesh axis splits at most one
dimension of a parameter. Splitting q/k/v inside a head (num_kv_heads not a multiple of
"tensor") is still correct — the partitioner moves data as needed — only slower.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec

__all__ = ["DEFAULT_RULES", "PARAM_AXES", "logical_axes", "param_specs", "path_name", "spec_for"]

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

# (regular expression searched in the "/"-joined path, logical axes of the trailing dims).
# The first match wins; an unmatched parameter is replicated.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|/)tokens/table$", ("vocab", "embed")),
    (r"(^|/)(positions|token_types)/table$", (None, "embed")),
    (r"(^|/)head/kernel$", ("embed", "vocab")),
    (r"(^|/)mlm_bias$", ("vocab",)),
    (r"(^|/)(query|key|value|position_proj)/kernel$", ("embed", "heads")),
    (r"(^|/)(query|key|value)/bias$", ("heads",)),
    (r"(^|/)out/kernel$", ("heads", "embed")),
    (r"(^|/)(up|gate)/kernel$", ("embed", "mlp")),
    (r"(^|/)(up|gate)/bias$", ("mlp",)),
    (r"(^|/)down/kernel$", ("mlp", "embed")),
    (r"(^|/)(pooler|mlm_transform)/kernel$", ("embed", None)),
    (r"(^|/)mlp/experts/(gate|up)$", ("expert", "embed", "mlp")),
    (r"(^|/)mlp/experts/down$", ("expert", "mlp", "embed")),
    (r"(^|/)mlp/router/kernel$", (None, None)),
)


def path_name(path: tuple) -> str:
    """A jax key path -> "stack/layers/0/attention/query/kernel" (the Variable's trailing
    `.value` attribute dropped)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey) and key.name != "value":
            parts.append(key.name)
    return "/".join(parts)


def logical_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axis of each of the `ndim` dimensions of the parameter at path `name`; extra
    leading dimensions (stacked layers) are "layers"."""
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, name) and ndim >= len(axes):
            return ("layers",) * (ndim - len(axes)) + axes
    return (None,) * ndim


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


def param_specs(params, mesh, rules: Mapping = DEFAULT_RULES):
    """A tree like `params` (the nnx.Param state, arrays or ShapeDtypeStructs) of
    PartitionSpecs, each from the parameter's path and shape. `mesh`: a Mesh or AbstractMesh
    (only its axis sizes are read)."""
    mesh_shape = dict(mesh.shape)
    return jax.tree.map_with_path(
        lambda path, x: spec_for(x.shape, logical_axes(path_name(path), len(x.shape)),
                                 mesh_shape, rules), params)
