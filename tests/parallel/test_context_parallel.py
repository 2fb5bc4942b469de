"""Context-parallel attention on 8 CPU devices (_context_parallel_worker.py, in a subprocess
because this one has a single device): values and gradients equal single-device reference
attention for causal / full / sliding-window / segment-id / padding / GQA / MQA cases, over
ring and all-gather exchanges and meshes that also split the batch or the heads; per-device
memory shrinks with the ring."""

import json
import os
import pathlib
import subprocess
import sys

import chex
import numpy as np
import pytest
from parallel._context_parallel_cases import CASES

WORKER = pathlib.Path(__file__).with_name("_context_parallel_worker.py")

# float32: the ring sums the softmax in another order than the reference (per chunk, merged by
# log-sum-exp); bfloat16 inputs and outputs round at 2^-8 relative.
TOLERANCE = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("context_parallel") / "run"
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    with np.load(out.with_suffix(".npz")) as arrays:
        arrays = {name: arrays[name] for name in arrays.files}
    return json.loads(out.with_suffix(".json").read_text()), arrays


@pytest.mark.parametrize("name", CASES)
def test_values_and_gradients_equal_one_device(results, name):
    report, arrays = results
    dtype = CASES[name][-1]
    for part in ("out", "dq", "dk", "dv"):
        found, expected = arrays[f"{name}:found:{part}"], arrays[f"{name}:expected:{part}"]
        assert np.abs(expected).max() > 0.1, part  # the case computes something
        chex.assert_trees_all_close(found, expected, **TOLERANCE[dtype])
    assert report["shard_map"][name]  # it ran split over the devices, not replicated


def test_a_decoder_under_a_sequence_mesh_runs_its_attention_split(results):
    report, arrays = results
    assert report["model_shard_map"]
    chex.assert_trees_all_close(arrays["model:found"], arrays["model:expected"],
                                **TOLERANCE["float32"])


def test_rows_that_see_no_key_are_zeros_and_hidden_keys_get_no_gradient(results):
    _, arrays = results
    found = {part: arrays[f"causal_padding_ring4:found:{part}"] for part in ("out", "dq", "dk")}
    assert all(np.isfinite(x).all() for x in found.values())
    # Row 1's last 10 queries (segment 3) see only its padded keys: zeros, zero gradient.
    assert np.all(found["out"][1, -10:] == 0.0) and np.all(found["dq"][1, -10:] == 0.0)
    assert np.all(found["dk"][1, -10:] == 0.0)  # and no query sees the padded keys


def test_per_device_memory_shrinks_with_the_ring(results):
    report, _ = results
    memory = {int(n): b for n, b in report["temp_bytes"].items()}
    for devices in (4, 8):
        assert memory[devices] <= 1.2 * memory[2] * 2 / devices, memory
