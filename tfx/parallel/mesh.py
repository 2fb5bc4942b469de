"""Device meshes: one named axis per kind of parallelism.

    data    pure data parallelism: replicas of the whole state, each on its own rows
    fsdp    data parallelism whose replicas split the parameters and the optimiser state
            (ZeRO-3 / FSDP), gathered layer by layer when used
    expert  expert parallelism for mixture-of-experts weights; the dense layers treat it as
            more data parallelism (the batch is split over it too, as in GShard)
    sequence context parallelism: every layer's activations split along the sequence, and
            self-attention run as ring / all-gather attention (tfx.ops.attention.context_parallel)
    tensor  Megatron-style tensor parallelism inside each layer

The order is outermost to innermost: `tensor` varies fastest over the device list, so its
devices are neighbours (on one host, on the fastest links), then `sequence`, whose ring passes
keys and values between neighbours at every layer, and `data` slowest, so that its
all-reduce — the only collective of pure data parallelism — is the one that crosses hosts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

__all__ = ["AXES", "make_mesh", "mesh_from_config", "resolve_mesh"]

AXES = ("data", "fsdp", "expert", "sequence", "tensor")


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, expert: int = 1,
              sequence: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ("data", "fsdp", "expert", "sequence", "tensor") over `devices`
    (default: all devices of all processes, `jax.devices()`).

    One axis may be -1: it takes the devices the others leave over. The sizes must multiply
    to the number of devices exactly (a ValueError names the axes otherwise). The axes are
    `AxisType.Auto`: shardings are given for parameters and inputs, and XLA's partitioner
    (GSPMD) propagates them through the computation, so model code needs no annotations.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "expert": expert, "sequence": sequence,
             "tensor": tensor}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or not (size >= 1 or size == -1):
            raise ValueError(f"mesh axis {name} must be an int >= 1 or -1, got {size!r}")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {free}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if len(devices) % fixed:
            others = " * ".join(f"{k}={v}" for k, v in sizes.items() if v != -1)
            raise ValueError(f"mesh axis {free[0]}=-1 takes the devices left over, but "
                             f"{len(devices)} devices are not divisible by {others} = {fixed}")
        sizes[free[0]] = len(devices) // fixed
    elif fixed != len(devices):
        product = " * ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"mesh axes {product} = {fixed} must multiply to the device count "
                         f"{len(devices)}")
    shape = tuple(sizes[name] for name in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def mesh_from_config(config, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """`make_mesh` from a config with fields data, fsdp, tensor and optionally expert and
    sequence (tfx.train.config.MeshConfig)."""
    return make_mesh(config.data, config.fsdp, config.tensor, getattr(config, "expert", 1),
                     getattr(config, "sequence", 1), devices=devices)


def resolve_mesh(mesh: Mesh | None) -> Mesh | None:
    """`mesh` (a jax Mesh), else the mesh of an enclosing `jax.set_mesh`, else None (no mesh:
    the default device). A TypeError names anything else passed as `mesh`."""
    if mesh is None:
        mesh = jax.sharding.get_mesh()  # an empty Mesh outside jax.set_mesh
        return None if mesh.empty else mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. tfx.parallel.make_mesh(...)) "
                        f"or None, got {type(mesh).__name__}")
    return mesh
