"""expert_parallel_moe = the single-device layer: _expert_parallel_worker.py runs it on meshes of
8 CPU devices (in a subprocess, because this one has a single device) against `moe` on all
tokens (dropless) or on each device's tokens alone (with a capacity: GShard's groups),
outputs, routing and gradients; see the worker's docstring for the references. The argument
checks run here, on an AbstractMesh: they fail at trace time, before any device is needed."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from tfx.ops.moe import ExpertWeights, expert_parallel_moe
from tfx.parallel import AXES

WORKER = pathlib.Path(__file__).with_name("_expert_parallel_worker.py")
# mesh (expert=8, or data=2 x expert=4) - experts (top-1 plain GELU, top-2 SwiGLU) - capacity.
CASES = [f"{mesh}-{kind}-{capacity}" for mesh in ("expert8", "data2_expert4")
         for kind in ("k1_plain_gelu", "k2_gated_silu") for capacity in ("dropless", "capacity")]
CASES += ["data2_expert4-gshard_rng_jitter-capacity",  # per-group rng = fold_in(rng, group)
          "jit_inside_set_mesh"]  # as the MoE module calls it, with a tensor axis and a mask
CASES += [f"nan_token_stays_local-{capacity}" for capacity in ("dropless", "capacity")]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("expert_parallel") / "report"
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          cwd=WORKER.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report) == set(CASES)
    return report


@pytest.mark.parametrize("case", CASES)
def test_same_as_single_device(report, case):
    assert report[case] == "ok", report[case]


def layer_args(tokens=32, d_model=4, experts=8, d_ff=8):
    x = jnp.zeros((tokens, d_model))
    weights = ExpertWeights(None, jnp.zeros((experts, d_model, d_ff)),
                            jnp.zeros((experts, d_ff, d_model)))
    return x, jnp.zeros((d_model, experts)), weights


def mesh(data=1, expert=8):
    return AbstractMesh((data, 1, expert, 1, 1), AXES)


@pytest.mark.parametrize("args, kwargs, message", [
    (layer_args(experts=6), dict(mesh=mesh(2, 4)),
     r"num_experts \(6, router_kernel's last dim\) must be divisible by the size of mesh axis "
     r"expert_axis='expert' \(4\)"),
    (layer_args(tokens=12), dict(mesh=mesh()),
     r"x's tokens \(12\) must be divisible by the 8 batch shards \(expert=8\)"),
    (layer_args(tokens=20), dict(mesh=mesh(2, 4)),
     r"x's tokens \(20\) must be divisible by the 8 batch shards \(data=2 x expert=4\)"),
    (layer_args(), dict(mesh=mesh(), expert_axis="experts"),
     r"expert_axis 'experts' is not an axis of mesh"),
    (layer_args(), dict(mesh=mesh(), batch_axes=("data", "fsdp")),
     r"batch_axes must be a tuple of mesh axis names that includes expert_axis='expert'"),
    (layer_args(), dict(mesh=mesh(), activation="swish"), r"activation must be one of"),
])
def test_bad_arguments_name_themselves(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        expert_parallel_moe(*args, num_selected=2, **kwargs)


def test_expert_weights_must_match_the_router():
    x, router, weights = layer_args()
    with pytest.raises(ValueError, match=r"weights.down must have shape \(8, 8, 4\)"):
        expert_parallel_moe(x, router, dataclasses.replace(weights, down=jnp.zeros((8, 8, 3))),
                            mesh=mesh(), num_selected=1)
    with pytest.raises(ValueError, match=r"token_mask must be bool \[tokens\] = \(32,\)"):
        expert_parallel_moe(x, router, weights, mesh=mesh(), num_selected=1,
                            token_mask=jnp.ones((16,), bool))
    assert jax.eval_shape(lambda: expert_parallel_moe(
        x, router, weights, mesh=mesh(), num_selected=1))[0].shape == x.shape
