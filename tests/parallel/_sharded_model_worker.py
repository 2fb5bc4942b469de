"""Worker for test_sharded_model.py (run as a script): on a mesh of 8 CPU devices, the tiny
char-gpt of _train_case.py made sharded (`tfx.parallel.init_sharded`, with `mesh=` and under
`jax.set_mesh`, and `tfx.models.create(mesh=)`), its train step compiled on meshes where XLA's
partitioner once replicated activations (its warnings go to stderr, which the test reads),
and a mesh whose "expert" axis splits nothing refused. Writes OUT.json.

    python _sharded_model_worker.py OUT
"""

import os

# Before jax starts: 8 CPU devices, the fastest compilation (the run is tiny), and no
# persistent compilation cache: a program loaded from it is not partitioned again, and would
# print no partitioner warning.
# The test session's XLA flags (tests/conftest.py: cheaper compiles) stay.
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           + os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"

import json
import sys

import jax
import numpy as np
from _train_case import MODEL, setup
from flax import nnx

from tfx.models import create
from tfx.models.decoder import Decoder
from tfx.models.presets import named_config
from tfx.nn.paths import path_name
from tfx.parallel import batch_sharding, init_sharded, make_mesh, shard, state_shardings
from tfx.train.objectives import causal_lm
from tfx.train.step import make_train_step

CONFIG = named_config("char-gpt").replace(**MODEL)
MESH = dict(data=2, fsdp=2, tensor=2)
# Meshes on which compiling the train step printed "Involuntary full rematerialization"
# (the token embeddings looked up split over d_model, the other activations over the batch).
COMPILED = {"data2_fsdp2_tensor2": MESH,
            "fsdp2_sequence2_tensor2": dict(data=1, fsdp=2, sequence=2, tensor=2)}


def placed(model: nnx.Module, reference: nnx.Module) -> dict:
    """{path: [str(PartitionSpec), largest difference from `reference`'s value]} of every
    variable of `model`."""
    expected = dict(nnx.to_flat_state(nnx.state(reference)))
    return {path_name(path): [str(var.get_value().sharding.spec), float(np.max(np.abs(
                np.asarray(var.get_value()) - np.asarray(expected[path].get_value()))))]
            for path, var in nnx.to_flat_state(nnx.state(model))}


def made_sharded(mesh) -> dict:
    """How each way of making the model sharded placed it, against the eager model."""
    reference = Decoder(CONFIG, rngs=nnx.Rngs(0))
    report = {"mesh": placed(init_sharded(lambda rngs: Decoder(CONFIG, rngs=rngs),
                                          nnx.Rngs(0), mesh=mesh), reference)}
    with jax.set_mesh(mesh):
        report["set_mesh"] = placed(init_sharded(lambda rngs: Decoder(CONFIG, rngs=rngs),
                                                 nnx.Rngs(0)), reference)
    try:  # needs `create(..., mesh=)` (tfx/models/presets.py)
        report["create"] = placed(create(CONFIG, rngs=nnx.Rngs(0), mesh=mesh), reference)
    except TypeError as error:
        report["create"] = str(error)
    return report


def compile_step(axes: dict) -> None:
    """Compile (not run) the train step of _train_case.py's model over `axes`."""
    mesh = make_mesh(**axes)
    graphdef, rest, state, optimizer = setup()
    shardings = state_shardings(state, mesh)
    step = make_train_step(graphdef, rest, optimizer, causal_lm, state_sharding=shardings,
                           mesh=mesh)
    tokens = jax.device_put(np.zeros((16, 33), np.int32), batch_sharding(mesh))
    step.lower(shard(state, shardings), {"tokens": tokens}).compile()


def refused_expert_axis() -> str:
    """The error of a train step over an "expert" axis for a model without experts."""
    mesh = make_mesh(data=2, expert=4)
    graphdef, rest, state, optimizer = setup()
    try:
        make_train_step(graphdef, rest, optimizer, causal_lm,
                        state_sharding=state_shardings(state, mesh), mesh=mesh)
    except ValueError as error:
        return str(error)
    return "not refused"


if __name__ == "__main__":
    out = sys.argv[1]
    report = made_sharded(make_mesh(**MESH))
    for name, axes in COMPILED.items():
        print(f"compiling {name}", file=sys.stderr, flush=True)
        compile_step(axes)
    report["compiled"] = list(COMPILED)
    report["expert_without_experts"] = refused_expert_axis()
    with open(out, "w") as f:
        json.dump(report, f)
