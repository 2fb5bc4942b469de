"""The PartitionSpec of every parameter of every preset (shrunk), with stacked layers, untied
heads, experts and PEFT parameters, as recorded in param_specs.json.

The record was made by the path-table rules that axis metadata replaced (tfx/parallel/rules.py
before issue 18), so this checks that declaring axes where parameters are made changed no
sharding. Columns: DEFAULT_RULES on 8-device meshes, and probe rules that send one logical axis
alone to "fsdp" (size 2, which divides every dim here), so that each probe shows exactly which
dims of each parameter carry that logical axis."""

import json
import pathlib

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

import tfx.models
import tfx.peft
from tfx.nn.paths import path_name
from tfx.parallel import AXES, DEFAULT_RULES, param_specs

RECORD = pathlib.Path(__file__).with_name("param_specs.json")
SHRINK = dict(vocab_size=96, d_model=32, num_heads=4, d_ff=64, num_layers=2)
# name -> (preset, config overrides beyond SHRINK, PEFT method attached or None)
VARIANTS = {
    **{preset: (preset, {}, None) for preset in tfx.models.PRESETS},
    **{preset + "+scan": (preset, {"compute": {"scan_layers": True}}, None)
       for preset in tfx.models.PRESETS},
    "char-gpt+untied": ("char-gpt", {"embeddings": {"tie": False}}, None),
    "gpt2-small+untied+scan": ("gpt2-small", {"embeddings": {"tie": False},
                                                "compute": {"scan_layers": True}}, None),
    "t5-small+untied": ("t5-small", {"embeddings": {"tie": False}}, None),
    "char-gpt+xl": ("char-gpt", {"position": "xl"}, None),
    "char-moe+shared+deepseek": ("char-moe", {"moe": {"shared_experts": 1,
                                                      "policy": "deepseek"}}, None),
    "llama-tiny+lora+scan": ("llama-tiny", {"compute": {"scan_layers": True}},
                             tfx.peft.LoRA(rank=2, targets=("query", "value", "down"))),
    "char-gpt+lora": ("char-gpt", {}, tfx.peft.LoRA(rank=2, targets=("query", "up", "tokens"))),
    "char-gpt+prefix": ("char-gpt", {}, tfx.peft.Prefix(num_tokens=3, projection=8)),
    "gpt2-small+adapters": ("gpt2-small", {}, tfx.peft.Adapters(size=4)),
    "bert-base+prompt": ("bert-base", {}, tfx.peft.SoftPrompt(num_tokens=3)),
}
# Column -> (mesh sizes (data, fsdp, expert, tensor), rules).
COLUMNS = {
    "fsdp8": ((1, 8, 1, 1), DEFAULT_RULES),
    "fsdp2_tensor4": ((1, 2, 1, 4), DEFAULT_RULES),
    "data2_fsdp2_tensor2": ((2, 2, 1, 2), DEFAULT_RULES),
    "fsdp2_expert2_tensor2": ((1, 2, 2, 2), DEFAULT_RULES),
    **{"only_" + axis: ((2, 2, 1, 2), {axis: "fsdp"})
       for axis in ("vocab", "embed", "heads", "mlp", "expert", "layers")},
}
# Parameters that the redesign moved (issue 18): (old, new) parts of "/" + path, applied to
# the record's paths. The specs must not change with the path.
MOVED = (
    ("/attention/position_proj/", "/attention/position/position_proj/"),
    ("/attention/content_bias", "/attention/position/content_bias"),
    ("/attention/position_bias", "/attention/position/position_bias"),
    ("/prompt/vectors", "/embeddings/prompt/vectors"),
)


def build(name: str) -> nnx.Module:
    """The variant's model, abstract (ShapeDtypeStructs: nothing is computed)."""
    preset, overrides, method = VARIANTS[name]

    def make():
        model = tfx.models.create(preset, rngs=nnx.Rngs(0), **SHRINK, **overrides)
        return model if method is None else method.attach(model, rngs=nnx.Rngs(1))

    return nnx.eval_shape(make)


def moved(path: str) -> str:
    """A recorded path as the parameter is named now."""
    path = "/" + path
    for old, new in MOVED:
        path = path.replace(old, new)
    return path[1:]


def spelled(spec: PartitionSpec) -> str:
    """A spec as the record spells it, `P('fsdp', None)`: jax versions before 0.9 print
    `PartitionSpec(...)` for the same value."""
    return "P(" + ", ".join(map(repr, spec)) + ("," if len(spec) == 1 else "") + ")"


def specs_of(name: str) -> dict[str, list[str]]:
    """{parameter path: [the spelled PartitionSpec per column of COLUMNS]}."""
    params = nnx.split(build(name), nnx.Param, ...)[1]
    out = {}
    for sizes, rules in COLUMNS.values():
        # (data, fsdp, expert, tensor) sizes, with no sequence split
        specs = param_specs(params, AbstractMesh((*sizes[:3], 1, sizes[3]), AXES), rules)
        leaves = jax.tree.leaves_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        for path, spec in leaves:
            out.setdefault(path_name(path), []).append(spelled(spec))
    return out


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(RECORD.read_text())


def test_record_covers_every_preset_and_column(record):
    assert set(record["columns"]) == set(COLUMNS)
    assert set(record["specs"]) == set(VARIANTS)
    assert {preset for preset, _, _ in VARIANTS.values()} == set(tfx.models.PRESETS)


@pytest.mark.parametrize("name", VARIANTS)
def test_specs_as_recorded(record, name):
    assert record["columns"] == list(COLUMNS)
    assert specs_of(name) == {moved(path): specs for path, specs in record["specs"][name].items()}
