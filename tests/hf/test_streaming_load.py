"""tfx.hf.load streams a checkpoint onto the devices without ever building the model with random
weights: parameters in the dtype asked for (a float32 file as bfloat16 holds the rounded file
values), stacked layers equal to the layer list, parameters in the shardings tfx.parallel gives
them on a mesh of 8 CPU devices (_streaming_worker.py, in a subprocess) with the one-device
logits; tfx.hf.save writes several files and their index when asked, and transformers reads
them."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from tfx import hf
from tfx.hf import gpt2, io, placement, saving, streaming
from tfx.models import create

WORKER = pathlib.Path(__file__).with_name("_streaming_worker.py")
IDS = jnp.arange(24).reshape(2, 12) % 50


@pytest.fixture(params=["on_host", "on_device"])
def assembled(request, monkeypatch) -> str:
    """Both ways parameters are assembled: on the host (CPU devices) and on the devices
    (accelerators; here forced onto the CPU device)."""
    if request.param == "on_device":
        monkeypatch.setattr(placement, "HOST_PLATFORMS", ())
    return request.param


def _llama(folder, **overrides):
    model = create("llama-tiny", rngs=nnx.Rngs(1), num_layers=2, d_model=32, num_heads=4,
                   attention={"num_kv_heads": 2}, d_ff=64, vocab_size=50, **overrides)
    hf.save(model, folder, architecture="LlamaForCausalLM")
    return model


def test_the_model_is_traced_never_built(tmp_path, monkeypatch, assembled):
    """The model is built only under a trace (no parameter is computed); under strict=False,
    the missing layer's parameters take create's initial values without it running eagerly."""
    folder = tmp_path / "ckpt"
    config = gpt2.config_from_hf(dict(vocab_size=19, n_embd=8, n_layer=2, n_head=2,
                                      n_positions=8), "GPT2LMHeadModel")
    hf.save(create(config, rngs=nnx.Rngs(1)), folder, architecture="GPT2LMHeadModel")
    config_json = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config_json, "n_layer": 3}))
    traced = []
    real = streaming.presets.build

    def spy(*args, **kwargs):
        traced.append(isinstance(jnp.zeros(()) + 1, jax.core.Tracer))
        return real(*args, **kwargs)

    with monkeypatch.context() as patch, pytest.warns(UserWarning, match="missing"):
        patch.setattr(streaming.presets, "build", spy)
        model = hf.load(folder, strict=False)
    assert traced == [True]
    fresh = io.flat_params(create(model.config))
    for path, value in io.flat_params(model).items():
        if 2 in path[:3]:
            np.testing.assert_array_equal(value, fresh[path], err_msg=str(path))


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_a_float32_file_loads_as_rounded_bfloat16(tmp_path, architecture, assembled):
    """dtype="bfloat16": every parameter (plain copies, converted on the device, and GPT-2's
    split q/k/v, converted on the host) is the file's value rounded to bfloat16."""
    if architecture == "LlamaForCausalLM":
        saved = _llama(tmp_path / "ckpt")
    else:
        config = gpt2.config_from_hf(dict(vocab_size=19, n_embd=8, n_layer=2, n_head=2,
                                          n_positions=8), architecture)
        saved = create(config, rngs=nnx.Rngs(1))
        hf.save(saved, tmp_path / "ckpt", architecture=architecture)
    loaded = io.flat_params(hf.load(tmp_path / "ckpt", dtype="bfloat16"))
    for path, value in io.flat_params(saved).items():
        assert loaded[path].dtype == ml_dtypes.bfloat16, path
        np.testing.assert_array_equal(loaded[path], value.astype(ml_dtypes.bfloat16),
                                      err_msg=str(path))


def test_scanned_layers_load_what_the_layer_list_loads(tmp_path, assembled):
    _llama(tmp_path / "ckpt")
    listed = hf.load(tmp_path / "ckpt")
    scanned = hf.load(tmp_path / "ckpt", compute={"scan_layers": True})
    expected = io.stack_layers(io.flat_params(listed))
    for path, value in io.flat_params(scanned).items():
        np.testing.assert_array_equal(value, expected[path], err_msg=str(path))
    np.testing.assert_allclose(scanned(IDS), listed(IDS), atol=1e-5)


def test_save_in_several_files_round_trips_and_transformers_reads_it(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = _llama(tmp_path / "one", embeddings={"tie": False})
    hf.save(model, tmp_path / "many", architecture="LlamaForCausalLM", max_shard_size="30KB")
    files = sorted(p.name for p in (tmp_path / "many").iterdir())
    shards = [name for name in files if name.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    every = {}
    for shard in shards:
        tensors = load_file(tmp_path / "many" / shard)
        assert sum(t.nbytes for t in tensors.values()) <= 30_000 or len(tensors) == 1
        every.update(tensors)
    assert every.keys() == load_file(tmp_path / "one" / "model.safetensors").keys()
    again = hf.load(tmp_path / "many")
    for path, value in io.flat_params(model).items():
        np.testing.assert_array_equal(io.flat_params(again)[path], value, err_msg=str(path))
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "many").eval()
    with torch.no_grad():
        logits = theirs(torch.tensor(np.asarray(IDS))).logits.numpy()
    np.testing.assert_allclose(logits, model(IDS), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("architecture, preset, overrides", [
    ("GPT2LMHeadModel", "gpt2-small", {}),  # q/k/v packed into one tensor per layer
    ("BertModel", "bert-base", {}),  # heads that a load may lack
    ("T5ForConditionalGeneration", "t5-small", {}),  # embeddings shared, encoder + decoder
    ("MixtralForCausalLM", "llama-tiny", {"moe": {"num_experts": 4, "experts_per_token": 2}}),
    ("LlamaForCausalLM", "llama-tiny", {"compute": {"scan_layers": True}}),  # stacked layers
])
def test_every_family_saves_in_several_files_and_loads_back(tmp_path, architecture, preset,
                                                           overrides):
    """Each file holds the real values of its tensors, whichever parameters they come from,
    though the others stood in for nothing while it was made."""
    model = create(preset, rngs=nnx.Rngs(2), num_layers=2, d_model=32, num_heads=4, d_ff=48,
                   vocab_size=99, **overrides)
    hf.save(model, tmp_path / "ckpt", architecture=architecture, max_shard_size="20KB")
    assert len(list((tmp_path / "ckpt").glob("model-*.safetensors"))) > 3
    again = io.flat_params(hf.load(tmp_path / "ckpt", compute=overrides.get("compute", {})))
    for path, value in io.flat_params(model).items():
        np.testing.assert_array_equal(again[path], value, err_msg=str(path))


def test_max_shard_size_must_be_a_size(tmp_path):
    assert saving.parse_size("5GB") == 5 * 10**9 and saving.parse_size("2MiB") == 2 * 2**20
    assert saving.parse_size(1000) == 1000
    model = create("llama-tiny", num_layers=1, d_model=8, num_heads=2, d_ff=8, vocab_size=8)
    for bad in ("five", 0, -3, True, "3 parsecs"):
        with pytest.raises(ValueError, match="max_shard_size must be a positive number"):
            hf.save(model, tmp_path / "x", architecture="LlamaForCausalLM", max_shard_size=bad)
    assert not (tmp_path / "x").exists()


def test_mesh_must_be_a_mesh(tmp_path):
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        hf.load(tmp_path, mesh="data=8")


# --- on a mesh of 8 CPU devices --------------------------------------------------------------

@pytest.fixture(scope="module")
def on_a_mesh(tmp_path_factory) -> tuple[dict, dict]:
    """(the worker's report, its logits by load)."""
    out = tmp_path_factory.mktemp("streaming") / "run.npz"
    done = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    with np.load(out) as saved:
        logits = {name: saved[name] for name in saved.files if name != "report"}
        return json.loads(str(saved["report"])), logits


@pytest.mark.parametrize("load", ["mesh", "set_mesh", "scanned_mesh", "mesh_on_device",
                                  "scanned_mesh_on_device"])
def test_parameters_land_in_their_shardings(on_a_mesh, load):
    """fsdp=2 x tensor=4: each parameter in the NamedSharding tfx.parallel's rules give it,
    split across the devices, not copied whole to each."""
    shardings = on_a_mesh[0][load]
    for name, (spec, expected, _) in shardings.items():
        assert spec == expected, name
    stacked = load.startswith("scanned")
    layer = "stack/layers/" if stacked else "stack/layers/0/"
    query = shardings[layer + "attention/query/kernel"]
    assert query[0] == ([None, "fsdp", "tensor"] if stacked else ["fsdp", "tensor"])
    assert query[2] == ([2, 16, 8] if stacked else [16, 8])  # one device's piece
    assert shardings["embeddings/tokens/table"][:2] == [["tensor", "fsdp"]] * 2
    assert shardings["stack/final_norm/scale"][:2] == [[], []]  # replicated


@pytest.mark.parametrize("load", ["mesh", "set_mesh", "scanned_mesh", "mesh_on_device",
                                  "scanned_mesh_on_device", "saved_from_mesh"])
def test_logits_on_a_mesh_equal_one_device(on_a_mesh, load):
    arrays = on_a_mesh[1]
    assert np.abs(arrays["one_device"]).max() > 0.1
    np.testing.assert_allclose(arrays[load], arrays["one_device"], atol=2e-5, rtol=1e-5)


def test_a_sharded_model_saves_in_several_files(on_a_mesh):
    files = on_a_mesh[0]["saved_files"]
    shards = [name for name in files if name.startswith("model-")]
    assert "model.safetensors.index.json" in files and shards[0].startswith("model-00001-of-")
