"""T5ForConditionalGeneration checkpoints: tfx.hf.load / save against transformers (eager, float32).

Two tiny random models cover both T5 flavours: T5 1.0 (ReLU MLP, head tied to the shared
embeddings and fed the decoder output scaled by d_model**-0.5) and v1.1 / Flan (gated-gelu =
gelu_new(wi_0 x) * wi_1 x, separate unscaled lm_head). The decoder has more layers than the
encoder, the encoder input is right-padded, and d_kv * num_heads differs from d_model.
"""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from causal_lm_parity import through_folder  # noqa: E402

import tfx.hf  # noqa: E402
from tfx.hf import t5  # noqa: E402

ARCH = "T5ForConditionalGeneration"
FLAVOURS = {
    "t5-1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "t5-1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def _hf_model(flavour: str):
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=99, d_model=32, d_kv=12, d_ff=48, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        layer_norm_epsilon=1e-6, decoder_start_token_id=0, attn_implementation="eager",
        **FLAVOURS[flavour])
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:  # ones at init: randomise so that a misplaced norm shows
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
        if not FLAVOURS[flavour]["tie_word_embeddings"]:
            # transformers 5 ties T5's lm_head at init; a v1.1 checkpoint has its own.
            model.lm_head.weight = torch.nn.Parameter(torch.randn(99, 32))
    return model


def _inputs():
    rng = np.random.default_rng(0)
    input_ids = rng.integers(2, 99, size=(2, 11))
    attention_mask = np.ones((2, 11), np.int64)
    attention_mask[1, 7:] = 0  # right padding
    input_ids[1, 7:] = 0
    decoder_input_ids = rng.integers(2, 99, size=(2, 9))
    decoder_input_ids[:, 0] = 0  # decoder_start_token_id
    return input_ids, attention_mask, decoder_input_ids


def _torch_logits(model, input_ids, attention_mask, decoder_input_ids) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(input_ids), attention_mask=torch.tensor(attention_mask),
                    decoder_input_ids=torch.tensor(decoder_input_ids))
    return out.logits.numpy()


def _tfx_logits(model, input_ids, attention_mask, decoder_input_ids) -> np.ndarray:
    return np.asarray(model(jnp.asarray(input_ids), attention_mask=jnp.asarray(attention_mask),
                            decoder_input_ids=jnp.asarray(decoder_input_ids)))


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """flavour -> (torch model, tfx model, torch logits), built once per module."""

    @functools.cache
    def load(flavour: str):
        hf_model = _hf_model(flavour)
        ours = through_folder(hf_model, tmp_path_factory.mktemp(flavour))
        return hf_model, ours, _torch_logits(hf_model, *_inputs())

    return load


@pytest.fixture(params=sorted(FLAVOURS))
def loaded(request, load):
    return load(request.param)


def test_logits_match_torch(loaded):
    hf_model, model, expected = loaded
    logits = _tfx_logits(model, *_inputs())
    assert logits.dtype == np.float32 and logits.shape == (2, 9, 99)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
    tied = hf_model.config.scale_decoder_outputs
    assert model.config.embeddings.tie is tied and model.config.scale_tied_head is tied
    assert model.config.decoder_layers == 3 and model.config.num_layers == 2


def test_encoder_padding_is_masked(loaded):
    """Changing padded encoder tokens changes nothing (the mask reaches the cross-attention)."""
    _, model, _ = loaded
    input_ids, attention_mask, decoder_input_ids = _inputs()
    other = input_ids.copy()
    other[1, 7:] = 42
    np.testing.assert_allclose(_tfx_logits(model, other, attention_mask, decoder_input_ids),
                               _tfx_logits(model, input_ids, attention_mask, decoder_input_ids),
                               rtol=1e-6, atol=1e-6)


def test_decoder_attention_mask_matches_torch(load):
    hf_model, model, _ = load("t5-1.1")  # one flavour is enough here, and saves time
    input_ids, attention_mask, decoder_input_ids = _inputs()
    decoder_mask = np.ones_like(decoder_input_ids)
    decoder_mask[0, 6:] = 0
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor(input_ids),
                            attention_mask=torch.tensor(attention_mask),
                            decoder_input_ids=torch.tensor(decoder_input_ids),
                            decoder_attention_mask=torch.tensor(decoder_mask)).logits.numpy()
    logits = model(jnp.asarray(input_ids), attention_mask=jnp.asarray(attention_mask),
                   decoder_input_ids=jnp.asarray(decoder_input_ids),
                   decoder_attention_mask=jnp.asarray(decoder_mask))
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-4, atol=1e-5)


def test_round_trip_through_transformers(loaded, tmp_path):
    _, model, expected = loaded
    tfx.hf.save(model, tmp_path / "saved", architecture=ARCH)
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(
        tmp_path / "saved", attn_implementation="eager").eval()
    np.testing.assert_allclose(_torch_logits(reloaded, *_inputs()), expected,
                               rtol=1e-4, atol=1e-5)
    again = tfx.hf.load(tmp_path / "saved")
    np.testing.assert_array_equal(_tfx_logits(again, *_inputs()), _tfx_logits(model, *_inputs()))


def test_functional_split_merge_under_jit(load):
    _, model, _ = load("t5-1.1")
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, input_ids, attention_mask, decoder_input_ids):
        return nnx.merge(graphdef, state)(input_ids, attention_mask=attention_mask,
                                          decoder_input_ids=decoder_input_ids)

    inputs = [jnp.asarray(x) for x in _inputs()]
    np.testing.assert_allclose(np.asarray(forward(state, *inputs)), _tfx_logits(model, *_inputs()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, field", [
    (dict(feed_forward_proj="gated-tanh", dense_act_fn="tanh"), "feed_forward_proj"),
    (dict(feed_forward_proj="tanh-gelu"), "feed_forward_proj"),
    (dict(tie_encoder_decoder=True), "tie_encoder_decoder"),
])
def test_unsupported_config_is_refused(change, field):
    hf = transformers.T5Config(vocab_size=99, d_model=32, num_heads=4, d_kv=8).to_dict()
    hf.update(change)
    with pytest.raises(ValueError, match=field):
        t5.config_from_hf(hf, ARCH)


def test_legacy_configs_pick_the_head():
    """transformers 4 configs carry only tie_word_embeddings; 5 adds scale_decoder_outputs."""
    base = dict(vocab_size=99, d_model=32, num_heads=4, d_kv=8, num_layers=2)
    flan = t5.config_from_hf({**base, "tie_word_embeddings": False,
                              "feed_forward_proj": "gated-gelu"}, ARCH)
    assert not flan.embeddings.tie and flan.mlp.activation == "gelu_tanh" and flan.mlp.gated
    original = t5.config_from_hf(base, ARCH)
    assert original.embeddings.tie and original.scale_tied_head
    assert original.mlp.activation == "relu"
    resaved = t5.config_from_hf({**base, "tie_word_embeddings": True,
                                 "scale_decoder_outputs": False}, ARCH)
    assert not resaved.embeddings.tie and not resaved.scale_tied_head


def test_config_to_hf_refuses_non_t5_models():
    config = t5.config_from_hf(transformers.T5Config(d_model=32, num_heads=4, d_kv=8).to_dict(),
                               ARCH)
    with pytest.raises(ValueError, match="position"):
        t5.config_to_hf(config.replace(position="rope"), ARCH)
    with pytest.raises(ValueError, match="num_kv_heads"):
        t5.config_to_hf(config.replace(attention={"num_kv_heads": 2}), ARCH)


def test_missing_and_unexpected_tensors_are_named(loaded, tmp_path):
    _, model, _ = loaded
    tensors = t5.params_to_hf(tfx.hf.io.flat_params(model), model.config)
    name = "decoder.block.2.layer.1.EncDecAttention.k.weight"
    with pytest.raises(ValueError, match=rf"{re.escape(name)}.*missing"):
        t5.params_from_hf({k: v for k, v in tensors.items() if k != name}, model.config)
    with pytest.raises(ValueError, match=r"decoder\.block\.3"):
        t5.params_from_hf({**tensors, "decoder.block.3.layer.0.layer_norm.weight": np.ones(32)},
                          model.config)


def test_head_tensors_follow_transformers():
    """A tied config accepts an lm_head.weight equal to the embeddings and refuses a different
    one; an untied head without lm_head.weight is the shared table (transformers ties them)."""
    hf = transformers.T5Config(vocab_size=99, d_model=32, num_heads=4, d_kv=8, num_layers=1,
                               d_ff=16).to_dict()
    tied = t5.config_from_hf({**hf, "scale_decoder_outputs": True}, ARCH)
    untied = t5.config_from_hf({**hf, "scale_decoder_outputs": False}, ARCH)
    abstract = nnx.eval_shape(lambda: tfx.models.create(untied))
    params = {path: np.ones(var.shape, np.float32)
              for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    tensors = t5.params_to_hf(params, untied)
    shared = np.random.default_rng(0).normal(size=(99, 32)).astype(np.float32)
    tensors.update({"shared.weight": shared, "lm_head.weight": shared.copy()})
    assert ("head", "kernel") not in t5.params_from_hf(tensors, tied)
    head_less = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    np.testing.assert_array_equal(t5.params_from_hf(head_less, untied)[("head", "kernel")],
                                  shared.T)
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        t5.params_from_hf({**tensors, "lm_head.weight": shared + 1}, tied)


def test_saved_config_is_plain_t5(loaded, tmp_path):
    _, model, _ = loaded
    tfx.hf.save(model, tmp_path, architecture=ARCH)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["d_kv"] == 12 and saved["num_decoder_layers"] == 3
    assert saved["feed_forward_proj"] == ("relu" if model.config.embeddings.tie else "gated-gelu")
