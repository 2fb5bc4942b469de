"""Child processes for test_checkpoint.py (run as a script, never collected by pytest).

    python _checkpoint_child.py kill DIRECTORY     save step 1, then SIGKILL itself while the
                                                   asynchronous save of step 2 is being written
    python _checkpoint_child.py sharded DIRECTORY  save an array sharded over 4 CPU devices and
                                                   restore it into another sharding (its
                                                   checksums verify); then flip a bit of one
                                                   shard on disk: a strict restore refuses it
"""

import os
import pathlib
import signal
import sys
import time

if sys.argv[1] == "sharded":  # must be set before jax starts
    # The test session's XLA flags (tests/conftest.py: cheaper compiles) stay.
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                               + os.environ.get("XLA_FLAGS", ""))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))  # tests/, for train_cases

import jax
import jax.numpy as jnp
import numpy as np
from train_cases import damage_payload

from tfx.train.checkpoint import Checkpoints, CorruptCheckpointError

CONFIG = {"model": "child"}


def big_state(step: int) -> dict:
    """64 MB of incompressible floats, so that writing them takes a while."""
    w = np.random.default_rng(step).standard_normal((4096, 4096), dtype=np.float32)
    return {"w": jnp.asarray(w), "step": jnp.int32(step)}


def kill(directory: str) -> None:
    ckpts = Checkpoints(directory, config=CONFIG, keep=1, async_save=True)
    ckpts.save(1, big_state(1))
    ckpts.wait()
    ckpts.save(2, big_state(2))  # returns once the arrays are on the host; writing goes on
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # die once orbax has started writing step 2's files
        tmp = [p for p in pathlib.Path(directory).glob("2.*") if p.is_dir()]
        if tmp and any(f.is_file() for f in tmp[0].rglob("*")):
            break
        time.sleep(0.001)
    print("killing", sorted(p.name for p in pathlib.Path(directory).iterdir()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def sharded(directory: str) -> None:
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    col = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
    # Random bits: incompressible, so that the shards lie on disk as they are, and 4 KiB a
    # shard: larger than what OCDBT stores inline in its b-tree nodes (which carry a CRC).
    bits = np.random.default_rng(0).integers(0, 2**31, (64, 64), dtype=np.int32)
    x = jax.device_put(bits.view(np.float32), row)
    template = {"x": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=col)}
    with Checkpoints(directory, config=CONFIG) as ckpts:
        ckpts.save(1, {"x": x})
    with Checkpoints(directory, config=CONFIG) as ckpts:
        step, out = ckpts.restore(template)
    assert step == 1 and out["x"].sharding == col, (step, out["x"].sharding)
    np.testing.assert_array_equal(np.asarray(out["x"]).view(np.int32), bits)
    damage_payload(pathlib.Path(directory) / "1", np.asarray(x.addressable_shards[3].data),
                   "flip_bit")
    with Checkpoints(directory, config=CONFIG) as ckpts:
        try:
            ckpts.restore(template, strict=True)
        except CorruptCheckpointError as e:
            assert "step 1" in str(e) and "checksums: x)" in str(e), e
        else:
            raise AssertionError("a damaged shard restored")
    print("sharded ok")


if __name__ == "__main__":
    {"kill": kill, "sharded": sharded}[sys.argv[1]](sys.argv[2])
