"""Checkpoint folders that are wrong in every way a user can make them wrong, and saves that
fail without losing the checkpoint already there."""

import json

import numpy as np
import pytest
from flax import nnx

from tfx import hf
from tfx.hf import io, tensorfiles
from tfx.models import create


def _model():
    return create("char-gpt", rngs=nnx.Rngs(0), num_layers=1, d_model=16, num_heads=2,
                  attention={"num_kv_heads": 1}, d_ff=32)


def test_not_a_folder(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        hf.load(tmp_path / "nothing-here")


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match=r"config.json is missing"):
        hf.load(tmp_path)


def test_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        hf.load(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architectures \['FalconForCausalLM'\] not supported"):
        hf.load(tmp_path)


def test_pickle_weights_are_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match=r"holds only pickle weights.*safetensors"):
        io.read_tensors(tmp_path)


def test_no_weights(tmp_path):
    with pytest.raises(ValueError, match=r"has no \*\.safetensors weights"):
        io.read_tensors(tmp_path)


def test_corrupt_safetensors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors"):
        io.read_tensors(tmp_path)


def test_truncated_safetensors(tmp_path):
    """A header whose offsets reach past the end of the file (a copy cut short) is refused
    from the header, naming the tensor, before anything is read."""
    from safetensors.numpy import save_file

    save_file({"a": np.ones(3, np.float32), "b": np.ones(4, np.float32)},
              str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors "
                                         r"file: tensor '.' \(float32 \[.\]\) has data_offsets"):
        io.read_tensors(tmp_path)


def test_sharded_index_naming_a_missing_shard(tmp_path):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors is listed"):
        io.read_tensors(tmp_path)


def test_sharded_checkpoint_is_read_whole(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "part-1.safetensors"))
    save_file({"b": np.zeros(2, np.float32)}, str(tmp_path / "part-2.safetensors"))
    index = {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    tensors = io.read_tensors(tmp_path)
    assert sorted(tensors) == ["a", "b"] and tensors["a"].shape == (3,)


def test_assign_params_names_what_is_wrong():
    model = _model()
    params = io.flat_params(model)
    path = ("embeddings", "tokens", "table")
    with pytest.raises(ValueError, match="missing \\['embeddings/tokens/table'\\]"):
        io.assign_params(model, {k: v for k, v in params.items() if k != path}, source="ckpt")
    with pytest.raises(ValueError, match="unexpected \\['bogus'\\]"):
        io.assign_params(model, {**params, ("bogus",): np.zeros(1)}, source="ckpt")
    bad = {**params, path: np.zeros((3, 3), np.float32)}
    with pytest.raises(ValueError, match=r"ckpt: tensor for embeddings/tokens/table has shape"):
        io.assign_params(model, bad, source="ckpt")


def test_assign_params_round_trip():
    model, other = _model(), create("char-gpt", rngs=nnx.Rngs(1), num_layers=1, d_model=16,
                                    num_heads=2, attention={"num_kv_heads": 1}, d_ff=32)
    io.assign_params(other, io.flat_params(model), source="test")
    for path, value in io.flat_params(model).items():
        np.testing.assert_array_equal(io.flat_params(other)[path], value)


def test_failed_save_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    hf.save(_model(), folder, architecture="LlamaForCausalLM")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def broken_write(path, tensors):
        path.write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(tensorfiles, "write", broken_write)
    with pytest.raises(OSError, match="disk full"):
        hf.save(_model(), folder, architecture="LlamaForCausalLM")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left behind


def test_save_rejects_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="architecture must be one of"):
        hf.save(_model(), tmp_path / "out", architecture="GPTJForCausalLM")


def test_load_dtype_is_the_parameter_and_compute_dtype(tmp_path):
    """`tfx.hf.load(path, dtype=)` as transformers' from_pretrained(dtype=): parameters stored
    in it and computing in it, the other compute settings kept; `compute={"dtype": ...}`
    alone changes the compute dtype only."""
    import jax.numpy as jnp

    model = create("llama-tiny", rngs=nnx.Rngs(0), num_layers=1, d_model=32, num_heads=4,
                   attention={"num_kv_heads": 2}, d_ff=64, vocab_size=50)
    hf.save(model, tmp_path / "llama", architecture="LlamaForCausalLM")
    fast = hf.load(tmp_path / "llama", dtype="bfloat16", compute={"scan_layers": True})
    assert fast.config.compute.dtype == fast.config.compute.param_dtype == "bfloat16"
    assert fast.config.compute.scan_layers
    assert fast.hidden_states(jnp.arange(6)[None]).dtype == jnp.bfloat16
    assert fast.stack.layers.attention.query.kernel[...].dtype == jnp.bfloat16
    compute_only = hf.load(tmp_path / "llama", compute={"dtype": "bfloat16"})
    assert compute_only.hidden_states(jnp.arange(6)[None]).dtype == jnp.bfloat16
    assert compute_only.stack.layers[0].attention.query.kernel[...].dtype == jnp.float32
    with pytest.raises(ValueError, match=r"dtype must be one of \('float16', 'bfloat16', "
                                         r"'float32'\) or None, got 'int8'"):
        hf.load(tmp_path / "llama", dtype="int8")


def test_save_and_load_with_scanned_layers(tmp_path):
    """A checkpoint written by tfx loads into per-layer and scanned models alike."""
    import jax.numpy as jnp

    from tfx.hf.io import flat_params

    model = create("llama-tiny", rngs=nnx.Rngs(0), num_layers=2, d_model=32, num_heads=4,
                   attention={"num_kv_heads": 2}, d_ff=64, vocab_size=50)
    hf.save(model, tmp_path / "llama", architecture="LlamaForCausalLM")
    listed = hf.load(tmp_path / "llama")
    scanned = hf.load(tmp_path / "llama", compute={"scan_layers": True})
    ids = jnp.arange(12)[None] % 50
    np.testing.assert_allclose(scanned(ids), model(ids), atol=1e-5)
    np.testing.assert_allclose(listed(ids), model(ids), atol=1e-5)
    hf.save(scanned, tmp_path / "again", architecture="LlamaForCausalLM")
    again = flat_params(hf.load(tmp_path / "again"))
    for path, value in flat_params(model).items():
        np.testing.assert_array_equal(again[path], value)
