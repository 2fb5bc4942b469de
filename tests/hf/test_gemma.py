"""Gemma2ForCausalLM / Gemma3ForCausalLM checkpoints: tfx.hf.load / save against transformers
(eager attention, float32).

Tiny random models of three layers (sliding, full, sliding) with a window of 4, narrower than
the sequences; 4 heads of head_dim 16 in a 32-wide model; query_pre_attn_scalar 24, not
head_dim. Weights are perturbed, so the (1 + weight) norms, all four per layer, matter.

- gemma2: attention soft-capping at 2 and final logit soft-capping at 3, caps low enough to
  change the logits of these weights; one RoPE for all layers; untied head.
- gemma3: per-head q/k norms; rope_parameters by layer type, a linear-scaled RoPE (theta 100)
  on the full layer and another base (theta 10) on the sliding ones; head tied to the
  embeddings, whose perturbed table is scaled back to about its initial size (std 0.02): a
  larger one, times sqrt(hidden_size), makes a tied head repeat the last token.

Each: logits on a right-padded batch at the real positions; greedy `tfx.generate` token for
token as HF's generate (whose cache keeps window - 1 keys for the sliding layers, all for the
full one; tfx keeps one linear cache and masks the window per layer) on left-padded prompts
and a decode longer than the window; `tfx.hf.save` read back by transformers (same weights up
to float32 rounding of 1 + w, same logits, same config).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from causal_lm_parity import (  # noqa: E402
    PROMPTS,
    assert_greedy_matches,
    hf_causal_lm,
    parity_tests,
    save_round_trips,
)

from tfx.hf import gemma  # noqa: E402

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
SEQ, WINDOW, NEW = 12, 4, 12
BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
            rms_norm_eps=1e-6, sliding_window=WINDOW, query_pre_attn_scalar=24)
CASES = {
    "gemma2": (GEMMA2, dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                            tie_word_embeddings=False)),
    "gemma3": (GEMMA3, dict(sliding_window_pattern=2, rope_parameters={
        "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=100.0),
        "sliding_attention": dict(rope_type="default", rope_theta=10.0)})),
}
_CLASSES = {GEMMA2: transformers.Gemma2Config, GEMMA3: transformers.Gemma3TextConfig}


def _hf_model(case: str):
    architecture, overrides = CASES[case]
    model = hf_causal_lm(torch, transformers, architecture, {**BASE, **overrides}, scale=0.3,
                         config_class=_CLASSES[architecture])
    if model.config.tie_word_embeddings:  # see the module docstring
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.05)
    return model


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    c = model.config
    assert c.attention.layer_types == ("sliding", "full", "sliding")
    assert (c.attention.sliding_window, c.attention.head_dim, c.kv_heads) == (WINDOW, 16, 2)
    assert c.attention.scale == 24**-0.5 and c.embeddings.scale and c.norm.outputs
    assert (c.mlp.activation, c.embeddings.tie) == ("gelu_tanh", case == "gemma3")
    if case == "gemma2":
        assert (c.attention.softcap, c.logit_softcap, c.attention.qk_norm) == (2.0, 3.0, None)
        assert (c.rope.theta, c.rope.scaling, c.rope.local_theta) == (10000.0, None, None)
    else:
        assert (c.attention.softcap, c.logit_softcap, c.attention.qk_norm) == (None, None,
                                                                               "per_head")
        assert (c.rope.theta, c.rope.scaling.factor, c.rope.local_theta) == (100.0, 2.0, 10.0)


def test_greedy_generation_matches_transformers(loaded):
    _, hf_model, model = loaded
    out = assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)
    # HF's cache: window - 1 keys on the sliding layers, every key on the full one.
    assert [type(layer).__name__ for layer in out.cache.layers] == [
        "DynamicSlidingWindowLayer", "DynamicLayer", "DynamicSlidingWindowLayer"]


def test_save_round_trips_through_transformers(loaded, tmp_path):
    case, hf_model, model = loaded
    reloaded = save_round_trips(torch, transformers, model, tmp_path, CASES[case][0], SEQ)
    # Weights come back as transformers wrote them; a norm's w = (1 + w) - 1 may round, but
    # 1 + w, what transformers multiplies by, is the same float32.
    original, saved = hf_model.state_dict(), reloaded.state_dict()
    for name, weight in saved.items():
        np.testing.assert_allclose(weight, original[name], rtol=0, atol=1e-7, err_msg=name)
        if "norm" in name:
            assert torch.equal(1.0 + weight, 1.0 + original[name]), name


def test_gemma3_legacy_rope_fields_read_like_rope_parameters():
    legacy = dict(BASE, rope_theta=100.0, rope_local_base_freq=10.0, sliding_window_pattern=2,
                  rope_scaling=dict(type="linear", factor=2.0))
    current = dict(BASE, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters=CASES["gemma3"][1]["rope_parameters"])
    assert gemma.config_from_hf(legacy, GEMMA3) == gemma.config_from_hf(current, GEMMA3)
    defaults = gemma.config_from_hf(BASE, GEMMA3)  # transformers' bases: 1e6 full, 1e4 sliding
    assert (defaults.rope.theta, defaults.rope.local_theta) == (1e6, 1e4)
    assert defaults.attention.layer_types == ("sliding", "sliding", "sliding")  # every 6th full


@pytest.mark.parametrize("architecture, fields, match", [
    (GEMMA2, dict(hidden_activation="gelu"), "hidden_activation"),
    (GEMMA2, dict(attention_bias=True), "attention_bias"),
    (GEMMA2, dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (GEMMA2, dict(sliding_window=None), "sliding_window"),
    (GEMMA2, dict(layer_types=["chunked_attention"] * 3), "layer_types"),
    (GEMMA2, dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (GEMMA3, dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (GEMMA3, dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)), "layer type"),
    (GEMMA3, dict(rope_parameters=dict(sliding_attention=dict(rope_type="linear", factor=2.0))),
     "sliding_attention"),
])
def test_unsupported_hf_settings_raise(architecture, fields, match):
    with pytest.raises(ValueError, match=match):
        gemma.config_from_hf(dict(BASE, **fields), architecture)


_TFX = gemma.config_from_hf(BASE, GEMMA2)


@pytest.mark.parametrize("architecture, changes, match", [
    (GEMMA2, dict(norm={"outputs": False}), r"norm\.outputs"),
    (GEMMA2, dict(embeddings={"scale": False}), r"embeddings\.scale"),
    (GEMMA2, dict(mlp={"activation": "silu"}), r"mlp\.activation"),
    (GEMMA2, dict(attention={"qk_norm": "per_head"}), r"attention\.qk_norm"),
    (GEMMA2, dict(rope={"local_theta": 10.0}), r"rope\.local_theta"),
    (GEMMA2, dict(attention={"scale": 0.3}), r"attention\.scale"),
    (GEMMA2, dict(attention={"sliding_window": None, "layer_types": None}),
     r"attention\.sliding_window"),
    (GEMMA3, dict(attention={"qk_norm": "per_head"}), r"attention\.softcap"),
    (GEMMA3, dict(attention={"qk_norm": "per_head", "softcap": None}), r"rope\.local_theta"),
])
def test_configs_transformers_cannot_express_raise(architecture, changes, match):
    with pytest.raises(ValueError, match=match):
        gemma.config_to_hf(_TFX.replace(**changes), architecture)


def test_default_scale_exports_as_head_dim():
    hf = gemma.config_to_hf(_TFX.replace(attention={"scale": None}), GEMMA2)
    assert hf["query_pre_attn_scalar"] == 16  # tfx's default scale, 1 / sqrt(head_dim)
    assert gemma.config_from_hf(hf, GEMMA2).attention.scale == 0.25
