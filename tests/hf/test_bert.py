"""tfx.hf BERT import/export against transformers' BertModel and BertForMaskedLM: tiny random
models saved with save_pretrained, loaded with tfx.hf.load, compared on the same inputs (right
padding, two token types); the pooler and MLM head; round trips back into transformers; and the
errors of the config and weight mapping."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import tfx.hf  # noqa: E402
from tfx.hf import bert, io  # noqa: E402
from tfx.models import EncoderConfig, create  # noqa: E402
from tfx.models.config import nested  # noqa: E402

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, max_position_embeddings=64, type_vocab_size=3)


def _hf(cls, **overrides):
    torch.manual_seed(0)
    config = transformers.BertConfig(**{**TINY, **overrides}, attn_implementation="eager")
    model = cls(config).eval()
    with torch.no_grad():  # non-zero biases and norm parameters, so a mix-up would show
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _save(model, path):
    model.save_pretrained(path, safe_serialization=True)
    return path


def _inputs():
    """Right-padded batch: row 1 has 7 real tokens; token types 0, then 1 from position 5."""
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    types[0, 9:] = 2
    return ids, mask, types


def _ours(model, ids, mask=None, types=None):
    def jax_or_none(x):
        return None if x is None else jnp.asarray(x.numpy())

    return model(jnp.asarray(ids.numpy()), attention_mask=jax_or_none(mask),
                 token_type_ids=jax_or_none(types))


def _close(ours, theirs, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
def test_bert_model_hidden_states_and_pooler(tmp_path, hidden_act):
    theirs = _hf(transformers.BertModel, hidden_act=hidden_act)
    ours = tfx.hf.load(_save(theirs, tmp_path))
    ids, mask, types = _inputs()
    with torch.no_grad():
        reference = theirs(ids, attention_mask=mask, token_type_ids=types)
    hidden = _ours(ours, ids, mask, types)
    assert hidden.dtype == jnp.float32 and hidden.shape == (2, 11, 32)
    # Padded positions too: both models compute them from the real keys only.
    _close(hidden, reference.last_hidden_state)
    _close(ours.pooled(hidden), reference.pooler_output)
    with torch.no_grad():  # defaults: no mask, token type 0
        _close(_ours(ours, ids), theirs(ids).last_hidden_state)


def test_masked_lm_checkpoint_loads_encoder_and_head(tmp_path):
    theirs = _hf(transformers.BertForMaskedLM)
    path = _save(theirs, tmp_path)
    assert any(name.startswith("bert.") for name in load_file(path / "model.safetensors"))
    ours = tfx.hf.load(path)
    ids, mask, types = _inputs()
    with torch.no_grad():
        logits = theirs(ids, attention_mask=mask, token_type_ids=types).logits
        hidden = theirs.bert(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    ours_hidden = _ours(ours, ids, mask, types)
    _close(ours_hidden, hidden)
    _close(ours.mlm_logits(ours_hidden), logits, rtol=1e-4)
    # BertForMaskedLM has no pooler: it keeps the Encoder's initial values.
    fresh = io.flat_params(create(ours.config))
    np.testing.assert_array_equal(io.flat_params(ours)[("pooler", "kernel")],
                                  fresh[("pooler", "kernel")])


def test_bert_model_checkpoint_keeps_initial_mlm_head(tmp_path):
    ours = tfx.hf.load(_save(_hf(transformers.BertModel), tmp_path))
    fresh = io.flat_params(create(ours.config))
    for path in (("mlm_transform", "kernel"), ("mlm_norm", "scale"), ("mlm_bias",)):
        np.testing.assert_array_equal(io.flat_params(ours)[path], fresh[path])


@pytest.mark.parametrize("cls", [transformers.BertModel, transformers.BertForMaskedLM])
def test_round_trip_through_transformers(tmp_path, cls):
    theirs = _hf(cls, hidden_act="gelu_new")
    ours = tfx.hf.load(_save(theirs, tmp_path / "hf"))
    tfx.hf.save(ours, tmp_path / "tfx", architecture=cls.__name__)
    back = cls.from_pretrained(tmp_path / "tfx", attn_implementation="eager").eval()
    ids, mask, types = _inputs()
    with torch.no_grad():
        before = theirs(ids, attention_mask=mask, token_type_ids=types)
        after = back(ids, attention_mask=mask, token_type_ids=types)
    for name in ("last_hidden_state", "pooler_output", "logits"):
        if name in before:
            np.testing.assert_array_equal(after[name].numpy(), before[name].numpy())
    again = tfx.hf.load(tmp_path / "tfx")  # and tfx reads back every parameter unchanged
    for path, value in io.flat_params(ours).items():
        np.testing.assert_array_equal(io.flat_params(again)[path], value, err_msg=str(path))


def test_config_mapping():
    hf = transformers.BertConfig(**TINY, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-7,
                                 pad_token_id=3).to_dict()
    config = bert.config_from_hf(hf, "BertModel")
    assert (config.d_model, config.num_layers, config.num_heads, config.d_ff, config.max_len,
            config.type_vocab_size, config.vocab_size) == (32, 2, 4, 37, 64, 3, 99)
    assert (config.mlp.activation, config.norm.eps, config.special_tokens.pad_id) == (
        "gelu_tanh", 1e-7, 3)
    assert (config.position, config.norm.pre_norm, config.use_bias, config.dropout) == (
        "learned", False, True, 0.0)
    written = bert.config_to_hf(config, "BertForMaskedLM")
    assert written["architectures"] == ["BertForMaskedLM"]
    assert bert.config_from_hf(written, "BertForMaskedLM") == config


@pytest.mark.parametrize("field, value, architecture", [
    ("position_embedding_type", "relative_key", "BertModel"),
    ("hidden_act", "tanh", "BertModel"),
    ("is_decoder", True, "BertModel"),
    ("add_cross_attention", True, "BertModel"),
    ("tie_word_embeddings", False, "BertForMaskedLM"),
])
def test_config_from_hf_rejects_unsupported_settings(tmp_path, field, value, architecture):
    config = transformers.BertConfig(**TINY).to_dict()
    config.update({field: value, "architectures": [architecture]})
    with pytest.raises(ValueError, match=field):
        bert.config_from_hf(config, architecture)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):  # before any weight is read
        tfx.hf.load(tmp_path)


@pytest.mark.parametrize("field, value", [("norm.pre_norm", True), ("position", "rope"),
                                          ("norm.kind", "rms"), ("use_bias", False),
                                          ("mlp.gated", True), ("attention.num_kv_heads", 2),
                                          ("attention.scale", 1.0)])
def test_config_to_hf_rejects_what_bert_cannot_express(field, value):
    config = EncoderConfig(vocab_size=99, d_model=32, num_layers=1, num_heads=4, d_ff=37,
                           **nested({"norm.pre_norm": False, field: value}))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        bert.config_to_hf(config, "BertModel")


def _edit_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("bert.encoder.layer.1.output.dense.bias"),
     r"bert.encoder.layer.1.output.dense.bias is missing"),
    (lambda t: t.pop("cls.predictions.transform.LayerNorm.weight"),
     r"cls.predictions.transform.LayerNorm.weight is missing .*masked-LM head"),
    (lambda t: t.update({"cls.seq_relationship.weight": np.zeros((2, 32), np.float32)}),
     r"cls.seq_relationship.weight.* no place"),
    (lambda t: t.update({"cls.predictions.decoder.weight": np.ones((99, 32), np.float32)}),
     r"cls.predictions.decoder.weight differs"),
])
def test_weight_errors_name_the_tensor(tmp_path, edit, message):
    path = _save(_hf(transformers.BertForMaskedLM), tmp_path)
    _edit_weights(path, edit)
    with pytest.raises(ValueError, match=message):
        tfx.hf.load(path)


def test_old_buffers_and_tied_decoder_copies_are_accepted(tmp_path):
    theirs = _hf(transformers.BertForMaskedLM)
    path = _save(theirs, tmp_path)

    def add_copies(tensors):
        tensors["bert.embeddings.position_ids"] = np.arange(64)[None]
        words = tensors["bert.embeddings.word_embeddings.weight"]
        tensors["cls.predictions.decoder.weight"] = words
        tensors["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"]

    _edit_weights(path, add_copies)
    ids, mask, types = _inputs()
    ours = tfx.hf.load(path)
    with torch.no_grad():
        logits = theirs(ids, attention_mask=mask, token_type_ids=types).logits
    _close(ours.mlm_logits(_ours(ours, ids, mask, types)), logits, rtol=1e-4)
