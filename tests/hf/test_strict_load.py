"""tfx.hf.load is strict: a checkpoint must hold exactly the tensors of the model its config
describes, as float16 / bfloat16 / float32 weights, in the files save_pretrained writes, inside
its folder; strict=False warns about missing / unexpected tensors instead (as transformers
does). Checkpoints here are tiny GPT-2 / LLaMA models written by tfx.hf.save, then edited."""

import json
import os

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tfx import hf
from tfx.hf import gpt2, io, llama
from tfx.models import create

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
GPT2_CONFIG = dict(vocab_size=19, n_embd=8, n_layer=2, n_head=2, n_positions=8)
LLAMA_CONFIG = dict(vocab_size=19, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8)
PER_GPT2_LAYER = 12  # ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj: weight + bias
WTE = "transformer.wte.weight"


def _saved(folder, architecture=GPT2, seed=1, **fields):
    """A checkpoint folder written by tfx.hf.save from a random model (seed != load's 0)."""
    family = gpt2 if architecture == GPT2 else llama
    base = GPT2_CONFIG if architecture == GPT2 else LLAMA_CONFIG
    model = create(family.config_from_hf({**base, **fields}, architecture), rngs=nnx.Rngs(seed))
    hf.save(model, folder, architecture=architecture)
    return folder, model


def _edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


def _edit_weights(folder, edit, name="model.safetensors"):
    tensors = load_file(folder / name)
    edit(tensors)
    save_file(tensors, str(folder / name))


def _assert_params_equal(ours, theirs):
    ours, theirs = io.flat_params(ours), io.flat_params(theirs)
    assert ours.keys() == theirs.keys()
    for path, value in theirs.items():
        np.testing.assert_array_equal(ours[path], value, err_msg=str(path))


# --- missing and unexpected tensors -------------------------------------------------------------

def test_weights_of_more_layers_than_the_config_are_refused(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    _edit_config(folder, n_layer=1)
    with pytest.raises(ValueError, match=rf"unexpected tensors \['transformer\.h\.1\.attn\.c_attn"
                                         rf"\.bias', .* \({PER_GPT2_LAYER} in all\).*strict=False"):
        hf.load(folder)


def test_strict_false_ignores_unexpected_tensors_with_a_warning(tmp_path):
    folder, saved = _saved(tmp_path / "ckpt")
    _edit_config(folder, n_layer=1)
    with pytest.warns(UserWarning, match=rf"\({PER_GPT2_LAYER} in all\).*ignored"):
        model = hf.load(folder, strict=False)
    assert model.config.num_layers == 1
    ours = io.flat_params(model)
    for path, value in io.flat_params(saved).items():
        if 1 not in path[:3]:  # everything but layer 1 is the checkpoint's
            np.testing.assert_array_equal(ours[path], value, err_msg=str(path))


def test_missing_tensors_are_counted_and_named(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    _edit_config(folder, n_layer=3)
    with pytest.raises(ValueError, match=rf"{PER_GPT2_LAYER} tensor\(s\) the model needs are "
                                         r"missing: tensor transformer\.h\.2\.ln_1\.weight is "
                                         r"missing .*'transformer\.h\.2\.ln_1\.bias'"):
        hf.load(folder)


def test_strict_false_keeps_initial_values_of_missing_tensors(tmp_path):
    folder, saved = _saved(tmp_path / "ckpt")
    _edit_config(folder, n_layer=3)
    with pytest.warns(UserWarning, match=r"missing.*initial values"):
        model = hf.load(folder, strict=False)
    initial = create(model.config)  # load builds with nnx.Rngs(0), as create does
    ours, fresh, theirs = (io.flat_params(m) for m in (model, initial, saved))
    for path, value in ours.items():
        expected = fresh[path] if 2 in path[:3] else theirs[path]
        np.testing.assert_array_equal(value, expected, err_msg=str(path))


def test_strict_false_fills_missing_layers_of_a_scanned_model(tmp_path):
    """Stacked layers ([num_layers, ...]): the rows of the missing layer are the model's own."""
    folder, saved = _saved(tmp_path / "ckpt")
    _edit_config(folder, n_layer=3)
    with pytest.warns(UserWarning, match="missing"):
        scanned = hf.load(folder, strict=False, compute={"scan_layers": True})
    fresh = io.flat_params(create(scanned.config))
    theirs = io.flat_params(saved)
    for path, value in io.flat_params(scanned).items():
        if "layers" not in path:
            np.testing.assert_array_equal(value, theirs[path], err_msg=str(path))
            continue
        at = path.index("layers") + 1
        rows = [theirs[(*path[:at], i, *path[at:])] for i in range(2)] + [fresh[path][2]]
        np.testing.assert_array_equal(value, np.stack(rows), err_msg=str(path))


def test_strict_must_be_a_bool(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    with pytest.raises(TypeError, match="strict must be True or False"):
        hf.load(folder, strict="no")


def test_buffers_transformers_ignores_are_ignored(tmp_path):
    """GPT-2's causal-mask buffers (bool/float), LLaMA's rotary inv_freq: not weights."""
    folder, saved = _saved(tmp_path / "gpt2")

    def add_buffers(tensors):
        tensors["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), bool))
        tensors["transformer.h.1.attn.masked_bias"] = np.asarray(-1e4, np.float32)

    _edit_weights(folder, add_buffers)
    _assert_params_equal(hf.load(folder), saved)
    folder, saved = _saved(tmp_path / "llama", LLAMA)
    _edit_weights(folder, lambda t: t.update({
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(2, np.float32)}))
    _assert_params_equal(hf.load(folder), saved)


@pytest.mark.parametrize("architecture, embeddings", [(GPT2, WTE),
                                                      (LLAMA, "model.embed_tokens.weight")])
def test_tied_head_copy_is_accepted_when_equal_and_refused_when_not(tmp_path, architecture,
                                                                     embeddings):
    folder, saved = _saved(tmp_path / "ckpt", architecture, tie_word_embeddings=True)
    _edit_weights(folder, lambda t: t.update({"lm_head.weight": t[embeddings].copy()}))
    _assert_params_equal(hf.load(folder), saved)
    _edit_weights(folder, lambda t: t.update({"lm_head.weight": t[embeddings] + 1}))
    with pytest.raises(ValueError, match=rf"lm_head\.weight differs from {embeddings}"):
        hf.load(folder)


# --- dtypes ---------------------------------------------------------------------------------------

def test_integer_weights_are_refused_not_cast(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    _edit_weights(folder, lambda t: t.update({WTE: t[WTE].astype(np.int8)}))
    with pytest.raises(ValueError, match=rf"{WTE} \(int8\).*quantized checkpoints are not "
                                         "supported"):
        hf.load(folder)


def test_float64_weights_are_refused(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    _edit_weights(folder, lambda t: t.update({WTE: t[WTE].astype(np.float64)}))
    with pytest.raises(ValueError, match=rf"{WTE} \(float64\)"):
        hf.load(folder, strict=False)  # not a matter of strictness


def test_half_precision_weights_load(tmp_path):
    import ml_dtypes

    folder, saved = _saved(tmp_path / "ckpt")
    _edit_weights(folder, lambda t: t.update({name: value.astype(ml_dtypes.bfloat16)
                                              for name, value in t.items()}))
    ours = io.flat_params(hf.load(folder))
    for path, value in io.flat_params(saved).items():
        np.testing.assert_array_equal(ours[path], value.astype(ml_dtypes.bfloat16)
                                      .astype(np.float32), err_msg=str(path))


def test_declared_quantization_is_refused(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    _edit_config(folder, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match=r"config\.json: quantization_config \(quant_method="
                                         r"'gptq'\).*not supported"):
        hf.load(folder)


# --- which files are read ------------------------------------------------------------------------

def test_a_stray_safetensors_file_is_not_read(tmp_path):
    folder, saved = _saved(tmp_path / "ckpt")
    stray = load_file(folder / "model.safetensors")
    stray[WTE] = stray[WTE] + 1
    save_file(stray, str(folder / "zz-stray.safetensors"))  # sorts after model.safetensors
    _assert_params_equal(hf.load(folder), saved)


def test_shards_without_an_index_are_refused(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    os.replace(folder / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    save_file({"x": np.ones(1, np.float32)}, str(folder / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"no model\.safetensors and no model\.safetensors\."
                                         r"index\.json, only \['model-00001-of-00002\."):
        hf.load(folder)


def _shard(folder):
    """Split model.safetensors into two shards a, b and an index; returns its weight_map."""
    tensors = load_file(folder / "model.safetensors")
    os.remove(folder / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(folder / "a.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(folder / "b.safetensors"))
    weight_map = {n: "a.safetensors" if i < half else "b.safetensors" for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def test_the_index_decides_which_shard_a_tensor_comes_from(tmp_path):
    folder, saved = _saved(tmp_path / "ckpt")
    weight_map = _shard(folder)
    other = {"a.safetensors": "b.safetensors", "b.safetensors": "a.safetensors"}[weight_map[WTE]]

    def plant_copies(tensors):  # another value in the other shard, and a tensor not indexed
        tensors[WTE] = np.zeros((19, 8), np.float32)
        tensors["transformer.h.9.ln_1.weight"] = np.zeros(8, np.float32)

    _edit_weights(folder, plant_copies, other)
    _assert_params_equal(hf.load(folder), saved)
    assert sorted(io.read_tensors(folder)) == sorted(weight_map)


def test_an_index_naming_the_wrong_shard_is_refused(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    weight_map = _shard(folder)
    other = {"a.safetensors": "b.safetensors", "b.safetensors": "a.safetensors"}[weight_map[WTE]]
    index = {"weight_map": {**weight_map, WTE: other}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"maps tensor\(s\) \['{WTE}'\] .* to {other}, "
                                         "which does not hold them"):
        hf.load(folder)


def test_an_index_and_model_safetensors_together_are_ambiguous(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    _shard(folder)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"holds both model\.safetensors and model\."
                                         r"safetensors\.index\.json"):
        hf.load(folder)


# --- files outside the folder ---------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["../outside.safetensors", "sub/../../outside.safetensors",
                                   "ABSOLUTE"])
def test_index_entries_outside_the_folder_are_refused(tmp_path, entry):
    folder, _ = _saved(tmp_path / "ckpt")
    weight_map = _shard(folder)
    os.replace(folder / "b.safetensors", tmp_path / "outside.safetensors")
    entry = str(tmp_path / "outside.safetensors") if entry == "ABSOLUTE" else entry
    index = {"weight_map": {n: entry if f == "b.safetensors" else f
                            for n, f in weight_map.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index\.json \(weight_map entry of .*is not a file "
                                         "name inside"):
        hf.load(folder)


def test_symlinks_out_of_the_folder_are_refused(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    _shard(folder)
    os.replace(folder / "b.safetensors", tmp_path / "outside.safetensors")
    (folder / "b.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ValueError, match=r"'b\.safetensors' is a symlink resolving to .*outside"):
        hf.load(folder)
    single, _ = _saved(tmp_path / "single")
    os.replace(single / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (single / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match=r"'model\.safetensors' is a symlink"):
        hf.load(single)


def test_symlinks_inside_the_folder_and_a_hub_cache_snapshot_load(tmp_path):
    """The hub cache: <repo>/snapshots/<revision>/<file> -> ../../blobs/<hash>."""
    _, saved = _saved(tmp_path / "src")
    repo = tmp_path / "models--tiny--gpt2"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    inner = tmp_path / "inner"
    (inner / "files").mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        os.replace(tmp_path / "src" / name, repo / "blobs" / f"hash-{name}")
        (snapshot / name).symlink_to(f"../../blobs/hash-{name}")
        (inner / "files" / name).symlink_to(repo / "blobs" / f"hash-{name}")
        (inner / name).symlink_to("files/" + name)  # a link inside the folder to one outside
    _assert_params_equal(hf.load(snapshot), saved)
    os.replace(repo / "blobs", inner / "blobs")  # now inner/files/* -> absent: re-point them
    for name in ("config.json", "model.safetensors"):
        (inner / "files" / name).unlink()
        (inner / "files" / name).symlink_to(inner / "blobs" / f"hash-{name}")
    _assert_params_equal(hf.load(inner), saved)


# --- config.json ---------------------------------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    pytest.param(bytes(range(128, 256)), r"config\.json is not UTF-8 text \(byte 0", id="bytes"),
    pytest.param(b"{not json", r"config\.json is not valid JSON", id="not-json"),
    pytest.param(b"[1, 2]", r"config\.json must hold a JSON object, got a JSON array",
                 id="array"),
    pytest.param(b'{"n_layer": 1, "n_layer": 2}', r"config\.json gives the key\(s\) "
                 r"\['n_layer'\] more than once", id="repeated-key"),
    pytest.param(b'{"architectures": "GPT2LMHeadModel"}', r"\"architectures\" must be a list",
                 id="architectures-not-a-list"),
])
def test_unreadable_configs_are_named(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        hf.load(tmp_path)
    assert str(tmp_path / "config.json") in str(error.value)


def test_a_config_symlinked_out_of_the_folder_is_refused(tmp_path):
    folder, _ = _saved(tmp_path / "ckpt")
    os.replace(folder / "config.json", tmp_path / "config.json")
    (folder / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"'config\.json' is a symlink"):
        hf.load(folder)


def test_checks_read_headers_only_and_each_tensor_once(tmp_path, monkeypatch):
    """Names and dtypes come from the headers; loading reads each tensor it uses once (the
    embeddings twice: once more for the tied copy's check) and never an unexpected one."""
    folder, _ = _saved(tmp_path / "ckpt", tie_word_embeddings=True)
    _edit_weights(folder, lambda t: t.update({"lm_head.weight": t[WTE].copy(),
                                              "transformer.h.5.ln_1.weight": np.ones(8)}))
    reads = []
    real = io.Checkpoint.__getitem__
    monkeypatch.setattr(io.Checkpoint, "__getitem__",
                        lambda self, name: reads.append(name) or real(self, name))
    with pytest.raises(ValueError, match=r"transformer\.h\.5\.ln_1\.weight"):
        hf.load(folder)
    assert reads == []
    with pytest.warns(UserWarning, match=r"transformer\.h\.5\.ln_1\.weight"):
        hf.load(folder, strict=False)
    everything = set(load_file(folder / "model.safetensors")) - {"transformer.h.5.ln_1.weight"}
    assert sorted(reads) == sorted([*everything, WTE])
