"""param_specs / state_specs: which mesh axes each parameter and optimiser-state leaf is split
over, checked against tables written out here. Only axis sizes matter, so the meshes are
AbstractMeshes (no devices needed); test_training.py checks the same specs on real devices."""

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import tfx.models
from tfx.nn import axes
from tfx.nn.moe import MoE
from tfx.nn.paths import path_name
from tfx.parallel import AXES, DEFAULT_RULES, batch_sharding, param_specs, state_specs
from tfx.train.config import OptimConfig
from tfx.train.optim import make_optimizer
from tfx.train.step import init_train_state

# Meshes as (data, fsdp, expert, tensor) sizes.
DATA8, FSDP8, FSDP2_TP4, DP2_FSDP2_TP2 = (8, 1, 1, 1), (1, 8, 1, 1), (1, 2, 1, 4), (2, 2, 1, 2)
MESHES = (DATA8, FSDP8, FSDP2_TP4, DP2_FSDP2_TP2)

# char-gpt, d_model 64, 4 heads of 16, 2 kv heads (key/value [64, 32]), d_ff 128, vocab 256:
# every dim divides every mesh axis. Megatron: q/k/v and up/gate split their output dim over
# tensor, out and down their input dim; FSDP splits the d_model dim; vectors replicated.
CHAR_GPT = dict(num_layers=2, d_model=64, num_heads=4, attention={"num_kv_heads": 2}, d_ff=128)
EXPECTED = {  # path suffix -> spec on DATA8, FSDP8, FSDP2_TP4, DP2_FSDP2_TP2
    "tokens/table": (P(), P(None, "fsdp"), P("tensor", "fsdp"), P("tensor", "fsdp")),
    "attention/query/kernel": (P(), P("fsdp"), P("fsdp", "tensor"), P("fsdp", "tensor")),
    "attention/key/kernel": (P(), P("fsdp"), P("fsdp", "tensor"), P("fsdp", "tensor")),
    "attention/value/kernel": (P(), P("fsdp"), P("fsdp", "tensor"), P("fsdp", "tensor")),
    "attention/out/kernel": (P(), P(None, "fsdp"), P("tensor", "fsdp"), P("tensor", "fsdp")),
    "mlp/gate/kernel": (P(), P("fsdp"), P("fsdp", "tensor"), P("fsdp", "tensor")),
    "mlp/up/kernel": (P(), P("fsdp"), P("fsdp", "tensor"), P("fsdp", "tensor")),
    "mlp/down/kernel": (P(), P(None, "fsdp"), P("tensor", "fsdp"), P("tensor", "fsdp")),
    "norm/scale": (P(), P(), P(), P()),
}


def mesh(sizes):
    """An abstract mesh of (data, fsdp, expert, tensor) sizes, with no sequence split."""
    return AbstractMesh((*sizes[:3], 1, sizes[3]), AXES)


def params_of(config="char-gpt", **overrides):
    """The model's parameters as ShapeDtypeStructs (nothing is computed)."""
    model = nnx.eval_shape(lambda: tfx.models.create(config, rngs=nnx.Rngs(0), **overrides))
    return nnx.split(model, nnx.Param, ...)[1]


def named(tree) -> dict:
    return {path_name(p): leaf for p, leaf in jax.tree.leaves_with_path(tree)}


def expected_for(name: str, column: int):
    matches = [specs for suffix, specs in EXPECTED.items() if name.endswith(suffix)]
    assert len(matches) == 1, f"{name} has no single expected spec"
    return matches[0][column]


@pytest.mark.parametrize("column, sizes", enumerate(MESHES))
def test_char_gpt_specs(column, sizes):
    specs = named(param_specs(params_of(**CHAR_GPT), mesh(sizes)))
    assert len(specs) == 20
    for name, spec in specs.items():
        assert spec == expected_for(name, column), name


def test_dims_not_divisible_by_their_axes_stay_replicated():
    # vocab 250 and d_ff 90 are not multiples of tensor=4; key/value [36, 18] neither.
    params = params_of(vocab_size=250, d_model=36, num_heads=4, attention={"num_kv_heads": 2},
                       d_ff=90, num_layers=1)
    specs = named(param_specs(params, mesh(FSDP2_TP4)))
    layer = "stack/layers/0/"
    assert specs["embeddings/tokens/table"] == P(None, "fsdp")
    assert specs[layer + "attention/query/kernel"] == P("fsdp", "tensor")  # [36, 36]
    assert specs[layer + "attention/key/kernel"] == P("fsdp")  # [36, 18]
    assert specs[layer + "attention/out/kernel"] == P("tensor", "fsdp")
    assert specs[layer + "mlp/up/kernel"] == P("fsdp")  # [36, 90]
    assert specs[layer + "mlp/down/kernel"] == P(None, "fsdp")
    # d_model 36 over fsdp=8: nothing splits.
    assert set(named(param_specs(params, mesh(FSDP8))).values()) == {P()}


def test_biases_untied_head_learned_positions_and_stacked_layers():
    params = params_of("gpt2-small", vocab_size=256, d_model=64, num_heads=4, d_ff=128,
                       num_layers=2, embeddings={"tie": False}, compute={"scan_layers": True})
    specs = named(param_specs(params, mesh(DP2_FSDP2_TP2)))
    layers = "stack/layers/"
    assert specs["head/kernel"] == P("fsdp", "tensor")  # [d_model, vocab]
    assert specs["embeddings/positions/table"] == P(None, "fsdp")
    # [num_layers, ...]: the stacked-layer axis is replicated ("layers" -> None).
    assert specs[layers + "attention/query/kernel"] == P(None, "fsdp", "tensor")
    assert specs[layers + "attention/out/kernel"] == P(None, "tensor", "fsdp")
    assert specs[layers + "mlp/down/kernel"] == P(None, "tensor", "fsdp")
    # Biases over heads or the MLP width follow the tensor split; over d_model replicated.
    assert specs[layers + "attention/query/bias"] == P(None, "tensor")
    assert specs[layers + "mlp/up/bias"] == P(None, "tensor")
    assert specs[layers + "attention/out/bias"] == P()
    assert specs[layers + "mlp/down/bias"] == P()
    assert specs[layers + "mlp_norm/bias"] == specs["stack/final_norm/scale"] == P()


def test_bert_heads():
    params = params_of("bert-base", vocab_size=256, d_model=64, num_heads=4, d_ff=128,
                       num_layers=1)
    specs = named(param_specs(params, mesh(DP2_FSDP2_TP2)))
    assert specs["pooler/kernel"] == specs["mlm_transform/kernel"] == P("fsdp")
    assert specs["mlm_bias"] == P("tensor")  # follows the tied, vocab-split table
    assert specs["embeddings/token_types/table"] == P(None, "fsdp")
    assert specs["embeddings/norm/scale"] == specs["pooler/bias"] == P()


def test_rules_table_maps_logical_axes():
    params = params_of(**CHAR_GPT)
    zero3 = {**DEFAULT_RULES, "embed": ("fsdp", "data")}  # shard d_model over both batch axes
    specs = named(param_specs(params, mesh(DP2_FSDP2_TP2), zero3))
    assert specs["stack/layers/0/attention/query/kernel"] == P(("fsdp", "data"), "tensor")
    # A mesh axis splits at most one dim of a parameter: the table's d_model stays whole.
    one_axis = {**DEFAULT_RULES, "vocab": "fsdp"}
    specs = named(param_specs(params, mesh(DP2_FSDP2_TP2), one_axis))
    assert specs["embeddings/tokens/table"] == P("fsdp")
    with pytest.raises(ValueError, match="'heads' to mesh axis 'model'"):
        param_specs(params, mesh(DP2_FSDP2_TP2), {**DEFAULT_RULES, "heads": "model"})


def test_declared_axes_must_match_dims():
    def specs(*names, shape=(8, 8)):
        value = jax.ShapeDtypeStruct(shape, "f4")
        return param_specs({"w": nnx.Param(value, **axes.metadata(*names)), "plain": value},
                           mesh(FSDP2_TP4))

    assert named(specs("embed", "heads")) == {"w": P("fsdp", "tensor"), "plain": P()}
    assert named(specs()) == {"w": P(), "plain": P()}  # no names: replicated
    with pytest.raises(ValueError, match=r"w: its metadata names 3 axes .* shape \(8, 8\)$"):
        specs("layers", "embed", "heads")
    with pytest.raises(ValueError, match=r"names 2 axes .* need transform_metadata"):
        specs("embed", "heads", shape=(2, 8, 8))


@pytest.mark.parametrize("sizes", [FSDP8, DP2_FSDP2_TP2])
def test_optimizer_state_follows_params(sizes):
    model = tfx.models.create("char-gpt", rngs=nnx.Rngs(0), **CHAR_GPT)
    _, _, state = init_train_state(model, make_optimizer(OptimConfig(), 10), seed=0)
    specs = named(state_specs(state, mesh(sizes)))
    assert {k: v for k, v in specs.items() if k.startswith("params/")} == {
        "params/" + k: v for k, v in named(param_specs(params_of(**CHAR_GPT), mesh(sizes))).items()}
    params = {k.removeprefix("params/"): v for k, v in specs.items() if k.startswith("params/")}
    moments = {k: v for k, v in specs.items() if "/mu/" in k or "/nu/" in k}
    assert len(moments) == 2 * len(params) == 40
    for name, spec in moments.items():
        assert spec == params[name.split("/mu/")[-1].split("/nu/")[-1]], name
    assert any(spec != P() for spec in moments.values())
    others = {k: v for k, v in specs.items() if not k.startswith("params/") and k not in moments}
    assert set(others) >= {"step", "rng"} and set(others.values()) == {P()}  # counts too


@pytest.mark.parametrize("sizes, spec", [(DATA8, P("data")), (FSDP2_TP4, P("fsdp")),
                                         (DP2_FSDP2_TP2, P(("data", "fsdp"))),
                                         ((1, 1, 1, 8), P())])
def test_batch_rows_split_over_data_and_fsdp(sizes, spec):
    assert batch_sharding(mesh(sizes)).spec == spec


def test_expert_weights_split_experts_over_expert_axis():
    # A MoE layer's parameters as the MoE module declares them: router [d_model, E]
    # replicated, experts [E, d_model, d_ff] / [E, d_ff, d_model] split over "expert", then
    # like the MLP; stacked as Stack stacks layers (a leading "layers" axis).
    def layer(experts, stacked=()):
        def make(rngs):
            return MoE(64, 128, num_experts=experts, experts_per_token=2, rngs=rngs)

        if stacked:
            make = nnx.split_rngs(splits=stacked[0])(nnx.vmap(
                make, in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"}))
        return nnx.state(nnx.eval_shape(lambda: make(nnx.Rngs(0))), nnx.Param)

    def specs(sizes, experts=8, stacked=()):
        params = {"stack": {"layers": {"0": {"mlp": layer(experts, stacked)}}}}
        return {k.removeprefix("stack/layers/0/mlp/"): v
                for k, v in named(param_specs(params, mesh(sizes))).items()}

    assert DEFAULT_RULES["expert"] == "expert"
    assert specs((1, 1, 8, 1)) == {"router/kernel": P(), "experts/gate": P("expert"),
                                   "experts/up": P("expert"), "experts/down": P("expert")}
    assert specs((1, 2, 2, 2)) == {
        "router/kernel": P(), "experts/gate": P("expert", "fsdp", "tensor"),
        "experts/up": P("expert", "fsdp", "tensor"), "experts/down": P("expert", "tensor", "fsdp")}
    # Without an expert axis the experts follow the dense MLP (FSDP and tensor parallelism).
    assert specs(DP2_FSDP2_TP2)["experts/down"] == P(None, "tensor", "fsdp")
    # 6 experts do not split over expert=4; stacked layers add a replicated leading dim.
    assert specs((2, 1, 4, 1), experts=6)["experts/up"] == P()
    assert specs((1, 2, 4, 1), stacked=(3,)) == {
        "router/kernel": P(), "experts/gate": P(None, "expert", "fsdp"),
        "experts/up": P(None, "expert", "fsdp"), "experts/down": P(None, "expert", None, "fsdp")}
    assert batch_sharding(mesh((2, 1, 4, 1))).spec == P(("data", "expert"))
