"""Sharded training = single-device training: _sharded_worker.py trains the tiny char-gpt of
_train_case.py (2 layers, GQA) for 3 AdamW steps on one device and over meshes of 8 CPU
devices, in a subprocess because this one has a single device."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from parallel._train_case import abstract_state, assert_same_training

from tfx.nn.paths import path_name
from tfx.parallel import AXES, state_specs

WORKER = pathlib.Path(__file__).with_name("_sharded_worker.py")
# The worker's sharded runs and their mesh sizes (data, fsdp, expert, sequence, tensor);
# fsdp8_accum2 accumulates 2 micro-batches per step; the *_sequence* runs are context-parallel.
MESHES = {"data8": (8, 1, 1, 1, 1), "fsdp8": (1, 8, 1, 1, 1),
          "data2_fsdp2_tensor2": (2, 2, 1, 1, 2), "fsdp8_accum2": (1, 8, 1, 1, 1),
          "data2_sequence4": (2, 1, 1, 4, 1), "fsdp2_sequence2_tensor2": (1, 2, 1, 2, 2)}
# A model with experts on one device and expert-parallel over data=2 x expert=4.
MOE_RUNS = ("moe_single", "moe_data2_expert4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sharded") / "runs"
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    report = json.loads(out.with_suffix(".json").read_text())
    with np.load(out.with_suffix(".npz")) as arrays:
        for name, result in report.items():
            if name not in MESHES and name not in ("single", *MOE_RUNS):
                continue
            result["params"] = {k.split(":", 1)[1]: arrays[k] for k in arrays.files
                                if k.startswith(name + ":")}
    assert set(report) == {"single", *MESHES, *MOE_RUNS, "row_range", "uneven_rows",
                           "uneven_batch"}
    return report


@pytest.mark.parametrize("name", MESHES)
def test_same_losses_and_params_as_one_device(runs, name):
    single = runs["single"]
    assert len(set(single["losses"])) == 3  # the steps do change the model
    assert_same_training(runs[name]["losses"], runs[name]["params"], single["losses"],
                         single["params"])


@pytest.mark.parametrize("name", MESHES)
def test_state_stays_sharded_as_specified(runs, name):
    expected = state_specs(abstract_state(), AbstractMesh(MESHES[name], AXES))
    expected = {path_name(p): str(spec) for p, spec in
                jax.tree.leaves_with_path(expected)}
    assert runs[name]["specs"] == expected


def test_parameters_and_moments_really_are_split(runs):
    shards = runs["data2_fsdp2_tensor2"]["shards"]
    key = "stack/layers/0/attention/key/kernel"  # [64, 32]: fsdp splits rows, tensor columns
    assert shards["params/" + key] == shards["opt_state/1/0/mu/" + key] == [32, 16]
    assert shards["opt_state/1/0/nu/stack/layers/1/mlp/down/kernel"] == [64, 32]  # [128, 64]
    assert shards["params/stack/final_norm/scale"] == [64]
    shards = runs["fsdp8"]["shards"]
    assert shards["params/embeddings/tokens/table"] == [256, 8]  # [256, 64] over fsdp=8
    assert shards["opt_state/1/0/mu/stack/layers/1/mlp/up/kernel"] == [8, 128]
    assert runs["data8"]["shards"]["params/embeddings/tokens/table"] == [256, 64]


def test_batch_rows_on_one_process_with_four_row_shards(runs):
    assert runs["row_range"] == [0, 16]
    assert runs["uneven_rows"] == ("local_rows: 6 rows do not split evenly over the 4 row shards "
                                   "of this process's devices")
    assert runs["uneven_batch"] == ("batch_size (10) must be a multiple of the 4 row shards of "
                                    "the batch sharding")


def test_expert_parallel_training_equals_one_device(runs):
    single, parallel = (runs[name] for name in MOE_RUNS)
    assert len(set(single["losses"])) == 3
    assert_same_training(parallel["losses"], parallel["params"], single["losses"],
                         single["params"])
    # [4 experts, 64, 64] split over expert=4; the router [64, 4] replicated.
    shards = parallel["shards"]
    assert shards["params/stack/layers/0/mlp/experts/up"] == [1, 64, 64]
    assert shards["opt_state/1/0/mu/stack/layers/1/mlp/experts/down"] == [1, 64, 64]
    assert shards["params/stack/layers/0/mlp/router/kernel"] == [64, 4]
