"""LlamaForCausalLM / MistralForCausalLM checkpoints: tfx.hf.load / save against transformers
(eager attention, float32).

Tiny random models cover GQA, MQA, biases, tied and untied heads, the RoPE scalings that HF
configs name (linear, dynamic NTK past max_position_embeddings, YaRN, llama3), and Mistral's
sliding window narrower than the sequence (with head_dim · heads != hidden_size). Inputs are a
right-padded batch; logits are compared at the real positions.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from causal_lm_parity import (  # noqa: E402
    assert_split_merge_under_jit,
    hf_causal_lm,
    parity_tests,
    save_round_trips,
)

from tfx.hf import io, llama  # noqa: E402
from tfx.models import DecoderConfig, create  # noqa: E402
from tfx.ops.positional import DynamicNTKScaling, NTKScaling  # noqa: E402

LLAMA, MISTRAL = "LlamaForCausalLM", "MistralForCausalLM"
SEQ = 12
BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-6)
# A small rope_theta puts several frequency bands inside 12 tokens, so every scaling shows.
CASES = {
    "gqa-untied": (LLAMA, dict()),
    "mqa-tied": (LLAMA, dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "mha-bias": (LLAMA, dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    "linear": (LLAMA, dict(rope_parameters=dict(rope_type="linear", rope_theta=100.0,
                                                factor=2.0))),
    "dynamic": (LLAMA, dict(max_position_embeddings=8, rope_parameters=dict(
        rope_type="dynamic", rope_theta=100.0, factor=2.0))),
    "yarn": (LLAMA, dict(rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=4.0,
                                              original_max_position_embeddings=64))),
    "llama3": (LLAMA, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=100.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32))),
    "mistral-window": (MISTRAL, dict(sliding_window=4, head_dim=16)),  # heads · 16 != d_model
}


def _hf_model(case: str):
    architecture, overrides = CASES[case]
    return hf_causal_lm(torch, transformers, architecture, {**BASE, **overrides})


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    config = model.config
    assert config.attention.sliding_window == (4 if case == "mistral-window" else None)
    assert config.embeddings.tie == (case == "mqa-tied")
    assert config.kv_heads == {"mqa-tied": 1, "mha-bias": 4}.get(case, 2)
    assert config.use_bias == (case == "mha-bias")
    assert (config.rope.scaling is None) == (case not in ("linear", "dynamic", "yarn", "llama3"))


def test_save_round_trips_through_transformers(loaded, tmp_path):
    case, _, model = loaded
    save_round_trips(torch, transformers, model, tmp_path / "out", CASES[case][0], SEQ)


@pytest.mark.parametrize("loaded", ["gqa-untied", "mistral-window"], indirect=True)
def test_functional_split_merge_under_jit(loaded):
    _, _, model = loaded
    assert_split_merge_under_jit(model, SEQ)


def test_legacy_rope_fields_read_like_rope_parameters():
    legacy = dict(BASE, rope_theta=500000.0, rope_scaling=dict(type="linear", factor=4.0))
    current = dict(BASE, rope_parameters=dict(rope_type="linear", rope_theta=500000.0,
                                              factor=4.0))
    config = llama.config_from_hf(legacy, LLAMA)
    assert config == llama.config_from_hf(current, LLAMA)
    assert config.rope.theta == 500000.0 and config.rope.scaling.factor == 4.0


def test_sliding_window_is_mistral_only():
    mistral = llama.config_from_hf(dict(BASE, sliding_window=None), MISTRAL)
    assert mistral.attention.sliding_window is None
    # transformers' Llama has no window: a stray field changes nothing there, nor here.
    stray = llama.config_from_hf(dict(BASE, sliding_window=4), LLAMA)
    assert stray.attention.sliding_window is None


@pytest.mark.parametrize("fields, match", [
    (dict(attention_bias=True, mlp_bias=False), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "rope_type"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(rope_parameters=dict(rope_type="linear", factor=-2.0)), "factor"),
])
def test_unsupported_hf_settings_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        llama.config_from_hf(dict(BASE, **fields), LLAMA)


_TFX = DecoderConfig(vocab_size=99, d_model=32, num_layers=1, num_heads=4, d_ff=48,
                     position="rope", norm={"kind": "rms"},
                     mlp={"activation": "silu", "gated": True}, use_bias=False)


@pytest.mark.parametrize("architecture, changes, match", [
    (LLAMA, dict(norm={"kind": "layer"}), r"norm\.kind"),
    (LLAMA, dict(position="learned"), "position"),
    (LLAMA, dict(rope={"layout": "interleaved"}), r"rope\.layout"),
    (LLAMA, dict(attention={"sliding_window": 4}), r"attention\.sliding_window"),
    (LLAMA, dict(rope={"scaling": NTKScaling(2.0)}), r"rope\.scaling"),
    (LLAMA, dict(rope={"scaling": DynamicNTKScaling(2.0, 16)}, max_len=32), "max_len"),
    (MISTRAL, dict(use_bias=True), "use_bias"),
    # Other families' layer parts: a save as LLaMA would compute something else.
    (LLAMA, dict(attention={"qk_norm": "per_head"}), r"attention\.qk_norm"),
    (MISTRAL, dict(attention={"sliding_window": 4, "layer_types": ("sliding",)}),
     r"attention\.layer_types"),
    (LLAMA, dict(attention={"softcap": 50.0}), r"attention\.softcap"),
    (LLAMA, dict(logit_softcap=30.0), "logit_softcap"),
    (LLAMA, dict(norm={"kind": "rms", "outputs": True}), r"norm\.outputs"),
    (LLAMA, dict(mlp={"parallel": True}), r"mlp\.parallel"),
    (LLAMA, dict(attention={"qkv_bias": True}), r"attention\.qkv_bias"),
    (MISTRAL, dict(attention={"qkv_bias": True, "out_bias": True}), "bias"),
])
def test_configs_transformers_cannot_express_raise(architecture, changes, match):
    with pytest.raises(ValueError, match=match):
        llama.config_to_hf(_TFX.replace(**changes), architecture)


def test_missing_tensor_is_named():
    config = llama.config_from_hf(dict(BASE, num_hidden_layers=1), LLAMA)
    tensors = llama.params_to_hf(io.flat_params(create(config)), config)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*missing"):
        llama.params_from_hf(tensors, config)
