"""GPT2LMHeadModel checkpoints: tfx.hf.load / save against transformers (eager attention,
float32).

Tiny random models cover the stock GPT-2 (gelu_new, head tied to wte, n_inner unset) and a
variant with an untied head, a ReLU MLP and an explicit n_inner. Inputs are a right-padded
batch; logits are compared at the real positions.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from causal_lm_parity import (  # noqa: E402
    assert_split_merge_under_jit,
    hf_causal_lm,
    parity_tests,
    save_round_trips,
)

from tfx.hf import gpt2, io  # noqa: E402
from tfx.models import create  # noqa: E402

ARCH = "GPT2LMHeadModel"
SEQ = 12
BASE = dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=16,
            layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0)
CASES = {
    "tied-gelu_new": dict(),
    "untied-relu": dict(tie_word_embeddings=False, activation_function="relu", n_inner=48),
    "gelu": dict(activation_function="gelu"),
}


def _hf_model(case: str):
    return hf_causal_lm(torch, transformers, ARCH, {**BASE, **CASES[case]})


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    config = model.config
    assert config.d_ff == (48 if case == "untied-relu" else 4 * 32)
    assert config.embeddings.tie == (case != "untied-relu")
    assert config.mlp.activation == {"tied-gelu_new": "gelu_tanh", "untied-relu": "relu",
                                 "gelu": "gelu"}[case]
    assert (config.max_len, config.norm.eps, config.dropout) == (16, 1e-5, 0.0)


def test_save_round_trips_through_transformers(loaded, tmp_path):
    _, _, model = loaded
    save_round_trips(torch, transformers, model, tmp_path / "out", ARCH, SEQ)


@pytest.mark.parametrize("loaded", ["tied-gelu_new"], indirect=True)
def test_functional_split_merge_under_jit(loaded):
    _, _, model = loaded
    assert_split_merge_under_jit(model, SEQ)


def test_fields_left_out_take_gpt2_defaults():
    config = gpt2.config_from_hf({"n_embd": 32, "n_layer": 1, "n_head": 4}, ARCH)
    assert (config.vocab_size, config.max_len, config.d_ff) == (50257, 1024, 128)
    assert config.mlp.activation == "gelu_tanh" and config.embeddings.tie


@pytest.mark.parametrize("fields, match", [
    (dict(scale_attn_weights=False), "scale_attn_weights"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    (dict(add_cross_attention=True), "add_cross_attention"),
    (dict(activation_function="swish"), "activation_function"),
])
def test_unsupported_hf_settings_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        gpt2.config_from_hf(dict(BASE, **fields), ARCH)


_TFX = gpt2.config_from_hf(BASE, ARCH)


@pytest.mark.parametrize("changes, match", [
    (dict(position="rope"), "position"),
    (dict(norm={"kind": "rms"}), r"norm\.kind"),
    (dict(mlp={"gated": True}), r"mlp\.gated"),
    (dict(use_bias=False), "use_bias"),
    (dict(attention={"num_kv_heads": 2}), r"attention\.num_kv_heads"),
    (dict(attention={"head_dim": 16}), r"attention\.head_dim"),
    (dict(mlp={"activation": "silu"}), r"mlp\.activation"),
])
def test_configs_gpt2_cannot_express_raise(changes, match):
    with pytest.raises(ValueError, match=match):
        gpt2.config_to_hf(_TFX.replace(**changes), ARCH)


def test_default_head_layout_spelled_out_is_accepted():
    explicit = _TFX.replace(attention={"num_kv_heads": 4, "head_dim": 8})
    assert gpt2.config_to_hf(explicit, ARCH) == gpt2.config_to_hf(_TFX, ARCH)


def test_missing_tensor_is_named():
    config = _TFX.replace(num_layers=1)
    tensors = gpt2.params_to_hf(io.flat_params(create(config)), config)
    del tensors["transformer.h.0.attn.c_attn.weight"]
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight.*missing"):
        gpt2.params_from_hf(tensors, config)


def test_tensors_saved_without_the_transformer_prefix_load():
    # OpenAI's GPT-2 on the hub was saved from GPT2Model: "h.0.ln_1.weight", "wte.weight", ...
    config = _TFX.replace(num_layers=1)
    params = io.flat_params(create(config))
    tensors = {name.removeprefix("transformer."): value
               for name, value in gpt2.params_to_hf(params, config).items()}
    loaded = gpt2.params_from_hf(tensors, config)
    assert loaded.keys() == params.keys()
    for path, value in params.items():
        np.testing.assert_array_equal(loaded[path], value)
