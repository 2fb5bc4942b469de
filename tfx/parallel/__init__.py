"""Parallel training: device meshes, parameter / optimiser-state / batch shardings, and
multi-process runs. See DESIGN.md; a typical use:

    mesh = make_mesh(data=-1, fsdp=2)
    model = init_sharded(lambda rngs: Decoder(config, rngs=rngs), nnx.Rngs(0), mesh=mesh)
    shardings = state_shardings(state, mesh)
    state = shard(state, shardings)
    step = make_train_step(..., state_sharding=shardings)
    batch = global_batch(process_rows(numpy_batch, batch_sharding(mesh)), batch_sharding(mesh))
"""

from tfx.parallel.distributed import global_batch, initialize, process_row_range, process_rows
from tfx.parallel.mesh import AXES, make_mesh, mesh_from_config, resolve_mesh
from tfx.parallel.rules import DEFAULT_RULES, logical_axes, param_specs
from tfx.parallel.sharding import (
    BATCH_AXES,
    batch_sharding,
    check_mesh_use,
    init_sharded,
    shard,
    state_shardings,
    state_specs,
)

__all__ = ["AXES", "BATCH_AXES", "DEFAULT_RULES", "batch_sharding", "check_mesh_use",
           "global_batch", "init_sharded", "initialize", "logical_axes", "make_mesh",
           "mesh_from_config", "param_specs", "process_row_range", "process_rows",
           "resolve_mesh", "shard", "state_shardings", "state_specs"]
