"""Worker for test_streaming_load.py (run as a script, because the 8 CPU devices must be set
before jax starts): a tiny LLaMA saved by tfx.hf.save, loaded on one device and onto a mesh
of 8 devices (fsdp=2 x tensor=4) in the ways tfx.hf.load offers, saved again from the mesh in
several files; the mesh loads also as accelerators assemble parameters (on the devices).
Writes OUT (an .npz file): each load's logits, and "report", a JSON string of
each load's parameter shardings and the files of the save.

    python _streaming_worker.py OUT
"""

import os

# Before jax starts: 8 CPU devices, beside the test session's XLA flags (tests/conftest.py).
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           + os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"

import json
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx import hf
from tfx.hf import placement
from tfx.models import create
from tfx.nn.paths import path_name
from tfx.parallel import make_mesh, param_specs


def shardings(model) -> dict:
    """path -> (the parameter's PartitionSpec, the one tfx.parallel's rules give it, the shape
    of the piece each device holds)."""
    state = nnx.state(model, nnx.Param)
    expected = dict(nnx.to_flat_state(param_specs(state, MESH)))
    return {path_name(path): [list(var.get_value().sharding.spec),  # a spec's repr varies
                              list(expected[path].get_value()),
                              list(var.get_value().addressable_shards[0].data.shape)]
            for path, var in nnx.to_flat_state(state)}


if __name__ == "__main__":
    out, report, arrays = sys.argv[1], {}, {}
    MESH = make_mesh(data=1, fsdp=2, tensor=4)
    ids = jnp.arange(24).reshape(2, 12) % 64
    folder = pathlib.Path(tempfile.mkdtemp())
    model = create("llama-tiny", rngs=nnx.Rngs(3), num_layers=2, d_model=32, num_heads=4,
                   attention={"num_kv_heads": 4}, d_ff=64, vocab_size=64)
    hf.save(model, folder / "ckpt", architecture="LlamaForCausalLM")
    loads = {"one_device": lambda: hf.load(folder / "ckpt"),
             "mesh": lambda: hf.load(folder / "ckpt", mesh=MESH),
             "scanned_mesh": lambda: hf.load(folder / "ckpt", mesh=MESH,
                                             compute={"scan_layers": True})}
    for name, load in loads.items():
        loaded = load()
        arrays[name] = np.asarray(loaded(ids))
        report[name] = shardings(loaded) if name != "one_device" else {}
    placement.HOST_PLATFORMS = ()  # as on accelerators: assembled on the devices
    for name in ("mesh", "scanned_mesh"):
        loaded = loads[name]()
        arrays[f"{name}_on_device"] = np.asarray(loaded(ids))
        report[f"{name}_on_device"] = shardings(loaded)
    placement.HOST_PLATFORMS = ("cpu",)
    with jax.set_mesh(MESH):  # the enclosing mesh, no mesh= argument
        loaded = hf.load(folder / "ckpt")
        arrays["set_mesh"] = np.asarray(loaded(ids))
    report["set_mesh"] = shardings(loaded)
    hf.save(loaded, folder / "again", architecture="LlamaForCausalLM", max_shard_size="20KB")
    report["saved_files"] = sorted(p.name for p in (folder / "again").iterdir())
    arrays["saved_from_mesh"] = np.asarray(hf.load(folder / "again")(ids))
    np.savez(out, report=np.asarray(json.dumps(report)), **arrays)
