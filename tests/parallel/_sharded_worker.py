"""Worker for test_training.py (run as a script): the tiny training run of _train_case.py on
one device and on several meshes of 8 CPU devices, written to OUT.npz (params) and OUT.json,
with a few checks of the batch helpers on such a mesh.

    python _sharded_worker.py OUT
"""

import os

# Before jax starts: 8 CPU devices, beside the test session's XLA flags (tests/conftest.py:
# the cheapest compiles; the run is tiny).
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           + os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"

import json
import sys

import numpy as np
from _train_case import MODEL, MOE_MODEL, train

from tfx.parallel import batch_sharding, global_batch, make_mesh, process_row_range

# name -> (mesh axes or None for one device, grad_accum, model)
CASES = {
    "single": (None, 1, MODEL),
    "data8": (dict(data=8), 1, MODEL),
    "fsdp8": (dict(data=1, fsdp=8), 1, MODEL),
    "data2_fsdp2_tensor2": (dict(data=2, fsdp=2, tensor=2), 1, MODEL),
    "fsdp8_accum2": (dict(data=1, fsdp=8), 2, MODEL),
    "moe_single": (None, 1, MOE_MODEL),
    "moe_data2_expert4": (dict(data=2, expert=4), 1, MOE_MODEL),
    "data2_sequence4": (dict(data=2, sequence=4), 1, MODEL),
    "fsdp2_sequence2_tensor2": (dict(data=1, fsdp=2, sequence=2, tensor=2), 1, MODEL),
}

if __name__ == "__main__":
    out, report, arrays = sys.argv[1], {}, {}
    for name, (axes, grad_accum, model) in CASES.items():
        result = train(None if axes is None else make_mesh(**axes), grad_accum=grad_accum,
                       model=model)
        arrays.update({f"{name}:{path}": value for path, value in result.pop("params").items()})
        report[name] = result
        print(name, result["losses"], flush=True)
    rows = batch_sharding(make_mesh(data=2, fsdp=2, tensor=2))  # 4 row shards
    report["row_range"] = process_row_range(16, rows)
    try:
        process_row_range(10, rows)
    except ValueError as e:
        report["uneven_batch"] = str(e)
    try:
        global_batch(np.zeros((6, 3)), rows)
    except ValueError as e:
        report["uneven_rows"] = str(e)
    np.savez(out + ".npz", **arrays)
    with open(out + ".json", "w") as f:
        json.dump(report, f)
