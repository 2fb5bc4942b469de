"""The "ragged" exchange of expert_parallel_moe (exactly the routed rows, ragged_all_to_all).

XLA:CPU cannot run ragged_all_to_all ("HLO opcode ragged-all-to-all is not supported by
XLA:CPU"), so the end-to-end check runs in _ragged_expert_parallel_worker.py with the
collective emulated from its documented semantics (see there), against the single-device
references of the fixed exchange. Here: `ragged_plan` as a pure function, and the checks that
run before any device work."""

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from tfx.ops.moe import ExpertWeights, expert_parallel, expert_parallel_moe
from tfx.ops.moe.expert_parallel import ragged_plan
from tfx.parallel import AXES

WORKER = pathlib.Path(__file__).with_name("_ragged_expert_parallel_worker.py")
ROOT = WORKER.parents[2]


@pytest.mark.slow
def test_ragged_exchange_equals_single_device(tmp_path):
    out = tmp_path / "report"
    # PYTHONPATH: the worker must import this checkout's tfx, whatever is installed.
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=WORKER.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert len(report) == 4
    assert all(v == "ok" for v in report.values()), report


def test_ragged_plan_sizes_offsets_and_receive_order():
    # 2 devices x 2 local experts. This device sends 1, 2 rows to device 0's experts and 0, 3
    # to device 1's; it receives 2, 0 rows from device 0 and 1, 1 from device 1.
    send = jnp.array([[1, 2], [0, 3]], jnp.int32)
    recv = jnp.array([[2, 0], [1, 1]], jnp.int32)
    plan = ragged_plan(send, recv, num_rows=6)
    np.testing.assert_array_equal(plan.send_sizes, [3, 3])
    np.testing.assert_array_equal(plan.input_offsets, [0, 3])
    np.testing.assert_array_equal(plan.recv_sizes, [2, 2])
    np.testing.assert_array_equal(plan.recv_offsets, [0, 2])
    # Received: source 0's two rows of expert 0, source 1's rows of experts 0 and 1, padding.
    np.testing.assert_array_equal(plan.receive_expert, [0, 0, 0, 1, 2, 2])


def test_ragged_plan_with_empty_sources():
    send = jnp.zeros((3, 1), jnp.int32)
    recv = jnp.array([[0], [2], [0]], jnp.int32)
    plan = ragged_plan(send, recv, num_rows=3)
    np.testing.assert_array_equal(plan.input_offsets, [0, 0, 0])
    np.testing.assert_array_equal(plan.recv_offsets, [0, 0, 2])
    np.testing.assert_array_equal(plan.receive_expert, [0, 0, 1])


def _layer_args(tokens=16, d_model=4, experts=8, d_ff=8):
    weights = ExpertWeights(None, jnp.zeros((experts, d_model, d_ff)),
                            jnp.zeros((experts, d_ff, d_model)))
    return jnp.zeros((tokens, d_model)), jnp.zeros((d_model, experts)), weights


@pytest.mark.parametrize("exchange, message", [
    ("ragged", r"exchange='ragged' needs jax.lax.ragged_all_to_all, which XLA implements on "
               r"GPU and TPU only; the platform is 'cpu'"),
    ("padded", r"exchange must be None or one of \('fixed', 'ragged'\), got 'padded'"),
])
def test_unavailable_or_unknown_exchange_raises(monkeypatch, exchange, message):
    monkeypatch.setattr(expert_parallel, "current_platform", lambda: "cpu")
    mesh = AbstractMesh((1, 1, 8, 1, 1), AXES)
    with pytest.raises(ValueError, match=message):
        expert_parallel_moe(*_layer_args(), mesh=mesh, num_selected=2, exchange=exchange)
