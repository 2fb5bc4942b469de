"""Sharding a model from Python (issue 46): `tfx.parallel.init_sharded` /
`tfx.models.create(mesh=)` make every parameter where `tfx.parallel` places it, the shardings
of `tfx.models.pure`'s params, mesh axes that split nothing refused, and a train step whose
compilation replicates no activation. The 8-device cases run in _sharded_model_worker.py."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

import tfx.models
from tfx.nn import axes
from tfx.nn.embeddings import TokenEmbedding
from tfx.nn.paths import path_name
from tfx.parallel import (
    AXES,
    check_mesh_use,
    init_sharded,
    make_mesh,
    param_specs,
    resolve_mesh,
    shard,
    state_shardings,
    state_specs,
)

WORKER = pathlib.Path(__file__).with_name("_sharded_model_worker.py")
# The worker's model (_train_case.MODEL) and mesh (data, fsdp, expert, sequence, tensor).
MODEL = dict(num_layers=2, d_model=64, num_heads=4, attention={"num_kv_heads": 2}, d_ff=128)
DP2_FSDP2_TP2 = AbstractMesh((2, 2, 1, 1, 2), AXES)


def abstract(name="char-gpt", **overrides) -> nnx.Module:
    """The model's structure and ShapeDtypeStructs, nothing computed."""
    return nnx.eval_shape(lambda: tfx.models.create(name, rngs=nnx.Rngs(0), **overrides))


def named(tree) -> dict:
    return {path_name(p): leaf for p, leaf in jax.tree.leaves_with_path(tree)}


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("sharded_model") / "report.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return json.loads(out.read_text()), proc.stderr


def test_state_shardings_take_the_params_of_pure():
    # Used to raise AttributeError: No attribute 'params' in State.
    model = tfx.models.create("char-gpt", rngs=nnx.Rngs(0), **MODEL)
    apply, params, rest = tfx.models.pure(model)
    specs = named(state_specs(params, DP2_FSDP2_TP2))
    assert specs == named(param_specs(params, DP2_FSDP2_TP2))
    assert specs["embeddings/tokens/table"] == PartitionSpec("tensor", "fsdp")
    placed = shard(params, state_shardings(params, make_mesh()))  # this process's one device
    ids = jnp.zeros((1, 4), jnp.int32)
    np.testing.assert_array_equal(apply(placed, rest, ids)[0], apply(params, rest, ids)[0])


def test_state_specs_of_a_plain_tree_of_variables():
    kernel = nnx.Param(jnp.zeros((64, 128)), **axes.metadata(axes.EMBED, axes.MLP))
    specs = state_specs({"mlp": {"up": kernel}, "count": jnp.zeros(())}, DP2_FSDP2_TP2)
    assert specs["mlp"]["up"].get_value() == PartitionSpec("fsdp", "tensor")
    assert specs["count"] == PartitionSpec()


@pytest.mark.parametrize("overrides, sizes, axis", [
    ({}, (2, 1, 4, 1, 1), "expert"),  # a dense model: nothing for experts to split
    ({"moe": {"num_experts": 6}}, (2, 1, 4, 1, 1), "expert"),  # 6 experts over 4 devices
    # heads x head_dim 48 (key/value 16), d_ff 96, vocab 256: none divides into 5
    ({"d_model": 48, "num_heads": 3, "attention": {"num_kv_heads": 1}, "d_ff": 96},
     (1, 1, 1, 1, 5), "tensor"),
])
def test_a_mesh_axis_that_splits_no_parameter_is_refused(overrides, sizes, axis):
    mesh = AbstractMesh(sizes, AXES)
    specs = state_specs(nnx.state(abstract(**overrides)), mesh)
    size = dict(mesh.shape)[axis]
    with pytest.raises(ValueError, match=rf"mesh\.{axis}={size} splits no parameter"):
        check_mesh_use(specs, mesh)


@pytest.mark.parametrize("overrides, sizes", [
    ({"moe": {"num_experts": 4}}, (2, 1, 4, 1, 1)),  # expert parallelism
    (MODEL, (1, 2, 1, 1, 4)),  # tensor parallelism
    (MODEL, (1, 1, 1, 1, 8)),  # 8 > 4 heads: splits inside heads (64 = 4 x 16), still splits
    (MODEL, (8, 1, 1, 1, 1)),  # data and fsdp split the batch whatever the model
])
def test_mesh_axes_that_split_parameters_pass(overrides, sizes):
    mesh = AbstractMesh(sizes, AXES)
    check_mesh_use(state_specs(nnx.state(abstract(**overrides)), mesh), mesh)


def test_resolve_mesh():
    mesh = make_mesh()
    assert resolve_mesh(None) is None
    assert resolve_mesh(mesh) is mesh
    with jax.set_mesh(mesh):
        assert resolve_mesh(None) == mesh
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        resolve_mesh({"data": 1})


def test_init_sharded_without_a_mesh_is_the_plain_build():
    rngs = nnx.Rngs(0)
    model = init_sharded(lambda rngs: TokenEmbedding(8, 4, rngs=rngs), rngs)
    np.testing.assert_array_equal(model.table[...],
                                  TokenEmbedding(8, 4, rngs=nnx.Rngs(0)).table[...])
    assert rngs.params.count[...] == 1  # advanced as the build used it
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        init_sharded(lambda: pytest.fail("built"), mesh=(("data", 1),))


def test_token_lookup_gathers_the_table_only_under_a_mesh_of_auto_axes():
    table = TokenEmbedding(8, 4, rngs=nnx.Rngs(0))
    ids = jnp.zeros((2, 3), jnp.int32)
    assert "sharding_constraint" not in str(jax.make_jaxpr(table)(ids))
    with jax.sharding.use_abstract_mesh(DP2_FSDP2_TP2):
        assert "sharding_constraint" in str(jax.make_jaxpr(table)(ids))
    explicit = AbstractMesh((2, 2, 1, 1, 2), AXES, axis_types=(AxisType.Explicit,) * 5)
    with jax.sharding.use_abstract_mesh(explicit):  # shardings are types: nothing to add
        assert "sharding_constraint" not in str(jax.make_jaxpr(table)(ids))


@pytest.mark.parametrize("way", ["mesh", "set_mesh"])
def test_init_sharded_places_every_variable(worker, way):
    report, _ = worker
    expected = named(state_specs(nnx.state(abstract(**MODEL)), DP2_FSDP2_TP2))
    placed = report[way]
    assert {k: spec for k, (spec, _) in placed.items()} == {k: str(v) for k, v in
                                                           expected.items()}
    assert placed["stack/layers/0/mlp/up/kernel"][0] == str(PartitionSpec("fsdp", "tensor"))
    # The values of the eager build, up to float rounding (compiled, not op by op).
    assert max(diff for _, diff in placed.values()) < 1e-7


def test_create_with_a_mesh(worker):
    # Needs `create(..., mesh=)` in tfx/models/presets.py (calling tfx.parallel.init_sharded).
    report, _ = worker
    assert isinstance(report["create"], dict), report["create"]
    assert report["create"] == report["mesh"]


def test_compiling_a_sharded_train_step_replicates_no_activation(worker):
    # XLA's partitioner printed "Involuntary full rematerialization" when the embeddings came
    # out split over d_model (from the FSDP-split table) and met batch-split activations.
    report, stderr = worker
    assert report["compiled"] == ["data2_fsdp2_tensor2", "fsdp2_sequence2_tensor2"]
    assert "Involuntary full rematerialization" not in stderr, stderr[-5000:]


def test_train_step_refuses_an_expert_axis_without_experts(worker):
    report, _ = worker
    assert report["expert_without_experts"].startswith(
        "mesh.expert=4 splits no parameter: the model has no mixture-of-experts layer")
