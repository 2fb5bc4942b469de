"""Several processes (hosts) as one JAX program, and feeding each its own rows of a batch.

Every process runs the same script. `initialize` must come before anything else touches jax's
devices; then `jax.devices()` lists the devices of all processes, a mesh spans them, and a
jitted step runs on all of them at once. Each process loads only the rows of the global batch
that its own devices hold (`process_row_range` / `process_rows`) and `global_batch` assembles
the global array from those pieces.
"""

from __future__ import annotations

import itertools
import os

import jax
import numpy as np
from jax.sharding import Sharding

__all__ = ["global_batch", "initialize", "process_row_range", "process_rows"]

_ENV = {"coordinator_address": "TFX_COORDINATOR_ADDRESS", "num_processes": "TFX_NUM_PROCESSES",
        "process_id": "TFX_PROCESS_ID"}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join a multi-process run; returns whether one was joined.

    Each argument left None is read from the environment (TFX_COORDINATOR_ADDRESS, e.g.
    "10.0.0.1:1234", the address of process 0; TFX_NUM_PROCESSES; TFX_PROCESS_ID). With one
    process (or none given) this does nothing. CPU processes exchange data through gloo.
    """
    address = coordinator_address or os.environ.get(_ENV["coordinator_address"]) or None
    num_processes = _int_setting("num_processes", num_processes)
    process_id = _int_setting("process_id", process_id)
    if num_processes is None and address is not None:
        raise ValueError(f"num_processes (or TFX_NUM_PROCESSES) is required with "
                         f"coordinator_address {address!r}")
    if num_processes is None or num_processes == 1:
        return False
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if address is None:
        raise ValueError("coordinator_address (or TFX_COORDINATOR_ADDRESS) is required when "
                         f"num_processes > 1, got num_processes={num_processes}")
    if process_id is None or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id (or TFX_PROCESS_ID) must be in [0, {num_processes}), "
                         f"got {process_id}")
    # Only read by the CPU backend; without it CPU computations cannot span processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                               process_id=process_id)
    return True


def _int_setting(name: str, value: int | None) -> int | None:
    if value is None:
        text = os.environ.get(_ENV[name])
        if not text:
            return None
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{_ENV[name]} must be an integer, got {text!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def process_row_range(batch_size: int, sharding: Sharding) -> tuple[int, int]:
    """[start, stop) of the rows of a global batch of `batch_size` rows that this process's
    devices hold under `sharding` (e.g. `tfx.parallel.batch_sharding(mesh)`)."""
    shards = sharding.num_devices // sharding.shard_shape((sharding.num_devices,))[0]
    if batch_size % shards:
        raise ValueError(f"batch_size ({batch_size}) must be a multiple of the {shards} row "
                         "shards of the batch sharding")
    pieces = sharding.addressable_devices_indices_map((batch_size,)).values()
    rows = sorted({(piece[0].start or 0, batch_size if piece[0].stop is None else piece[0].stop)
                   for piece in pieces})
    start, stop = rows[0][0], rows[-1][1]
    if any(a[1] != b[0] for a, b in itertools.pairwise(rows)):
        raise ValueError(f"this process's rows {rows} of the batch are not contiguous; "
                         "order the mesh's devices by process (jax.devices() does)")
    return start, stop


def process_rows(batch, sharding: Sharding):
    """This process's rows of `batch` (a numpy array or a tree of them, leading [batch] axis,
    the same global batch in every process): what to pass to `global_batch`."""
    sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"batch arrays must share one leading size, got {sorted(sizes)}")
    start, stop = process_row_range(sizes.pop(), sharding)
    return jax.tree.map(lambda x: x[start:stop], batch)


def global_batch(local_rows, sharding: Sharding):
    """One global jax.Array (or a tree of them) from each process's rows.

    local_rows: numpy arrays [rows_here, ...], this process's `process_rows` (with one process,
    the whole batch). Returns arrays [rows_here × row groups of processes, ...] on `sharding`.
    """
    def build(x):
        x = np.asarray(x)
        groups = _local_row_groups(sharding, x.shape)
        if x.shape[0] % groups:
            raise ValueError(f"local_rows: {x.shape[0]} rows do not split evenly over the "
                             f"{groups} row shards of this process's devices")
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(build, local_rows)


def _local_row_groups(sharding: Sharding, shape: tuple[int, ...]) -> int:
    """How many different row blocks this process's devices hold."""
    probe = (sharding.num_devices, *shape[1:])  # divisible by any number of row shards
    pieces = sharding.addressable_devices_indices_map(probe).values()
    return len({piece[0].indices(probe[0]) for piece in pieces})
