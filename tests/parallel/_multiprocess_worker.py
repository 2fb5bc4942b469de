"""Worker for test_multiprocess.py (run as a script): the tiny training run of _train_case.py,
data-parallel over 2 processes × 2 CPU devices (mesh data=2, fsdp=2) joined through
TFX_COORDINATOR_ADDRESS / TFX_NUM_PROCESSES / TFX_PROCESS_ID, or on one device when those
are unset. Process 0 (or the single process) writes OUT.npz (params) and OUT.json; every
process writes OUT.<process index>.rows.json, the batch rows it fed.

    python _multiprocess_worker.py OUT
"""

import os

# Before jax starts: 2 CPU devices, beside the test session's XLA flags (tests/conftest.py:
# the cheapest compiles; the run is tiny).
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=2 "
                           + os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"

import json
import sys

import jax
import numpy as np
from _train_case import BATCH, train

from tfx.parallel import batch_sharding, initialize, make_mesh, process_row_range

if __name__ == "__main__":
    out = sys.argv[1]
    distributed = initialize()  # from the environment
    mesh = make_mesh(data=2, fsdp=2) if distributed else None
    result = train(mesh)
    rows = process_row_range(BATCH, batch_sharding(mesh)) if distributed else (0, BATCH)
    with open(f"{out}.{jax.process_index()}.rows.json", "w") as f:
        json.dump({"rows": rows, "process_count": jax.process_count(),
                   "devices": jax.device_count(), "local_devices": jax.local_device_count()}, f)
    if jax.process_index() == 0:
        np.savez(out + ".npz", **result.pop("params"))
        with open(out + ".json", "w") as f:
            json.dump(result, f)
    print("process", jax.process_index(), "losses", result["losses"], flush=True)
