"""Gemma4ForCausalLM checkpoints (text config, model_type "gemma4_text"): tfx.hf.load / save
against transformers (eager attention, float32).

Tiny random models of five layers (sliding, full, sliding, sliding, full) with a window of 4,
narrower than the sequences; 4 heads of head_dim 16 on the sliding layers, global_head_dim 32
on the full ones, in a 32-wide model. Weights are perturbed, so every norm, the value-less
v_norm aside, and the layer scalars matter.

- ple_shared: per-layer embeddings (hidden_size_per_layer_input 8), the last two layers
  sharing keys and values (a sliding one reading layer 2's, a full one reading layer 1's), a
  proportional rope (half the pairs turning, theta 100) on the full layers and another base
  (theta 10) on the sliding ones, final logit soft-capping at 3, MLPs twice as wide on the
  shared layers (use_double_wide_mlp); head tied to the embeddings,
  scaled back to about their initial size (see tests/hf/test_gemma.py).
- k_eq_v: attention_k_eq_v with num_global_key_value_heads 1 (the full layers' values are
  their keys' projection, one KV head), no per-layer embeddings, no sharing, untied head.

Each: logits on a right-padded batch at the real positions; greedy `tfx.generate` token for
token as HF's generate on left-padded prompts with a decode longer than the window;
`tfx.hf.save` read back by transformers (same weights, logits and config).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from causal_lm_parity import (  # noqa: E402
    PROMPTS,
    assert_greedy_matches,
    assert_logits_match,
    hf_causal_lm,
    parity_tests,
    perturb,
    save_round_trips,
)

import tfx.hf  # noqa: E402
from tfx.hf import gemma4  # noqa: E402
from tfx.ops.positional import ProportionalScaling  # noqa: E402

GEMMA4 = "Gemma4ForCausalLM"
SEQ, WINDOW, NEW = 12, 4, 12
KINDS = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
         "full_attention"]
BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
            max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=WINDOW,
            layer_types=KINDS, vocab_size_per_layer_input=99, rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=10.0),
                "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.5,
                                       rope_theta=100.0)})
CASES = {
    "ple_shared": dict(hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                       final_logit_softcapping=3.0, use_double_wide_mlp=True),
    "k_eq_v": dict(hidden_size_per_layer_input=0, attention_k_eq_v=True,
                   num_global_key_value_heads=1, tie_word_embeddings=False),
}


def _hf_model(case: str):
    model = hf_causal_lm(torch, transformers, GEMMA4, {**BASE, **CASES[case]}, scale=0.3,
                         config_class=transformers.Gemma4TextConfig)
    if model.config.tie_word_embeddings:  # a large tied table repeats the last token
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.05)
    return model


loaded, test_logits_match_transformers = parity_tests(torch, {c: c for c in CASES}, _hf_model,
                                                      SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    c = model.config
    assert c.attention.layer_types == ("sliding", "full", "sliding", "sliding", "full")
    assert (c.attention.scale, c.attention.value_norm, c.norm.layer_scale) == (1.0, True, True)
    assert (c.attention.head_dim, c.attention.full_head_dim) == (16, 32)
    assert (c.rope.theta, c.rope.local_theta) == (100.0, 10.0)
    assert c.rope.scaling == ProportionalScaling(0.5)
    if case == "ple_shared":
        assert (c.embeddings.per_layer_width, c.embeddings.per_layer_vocab_size) == (8, 99)
        assert (c.attention.shared_kv_layers, c.logit_softcap) == (2, 3.0)
        assert model.stack.kv_sources == (None, None, None, 2, 1)  # transformers' rule
        assert c.mlp.wide_shared  # use_double_wide_mlp: the shared layers' MLPs widen
        widths = [block.mlp.up.kernel.shape[1] for block in model.stack.layers]
        assert widths == [48] * 3 + [96] * 2
    else:
        assert c.embeddings.per_layer_width is None and model.per_layer_embeddings is None
        assert (c.attention.full_kv_heads, c.attention.full_values_are_keys) == (1, True)
        assert c.layer_heads("full") == (1, 32) and c.layer_heads("sliding") == (2, 16)
        assert model.stack.layers[1].attention.value is None


def test_greedy_generation_matches_transformers(loaded):
    case, hf_model, model = loaded
    assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)
    cache = model.init_cache(2, 8)
    shared = [layer is None for layer in cache.layers]
    assert shared == [False, False, False] + [case == "ple_shared"] * 2  # sharers cache nothing
    assert cache.layers[1].key.shape[1:] == ((2 if case == "ple_shared" else 1), 8, 32)


def test_save_round_trips_through_transformers(loaded, tmp_path):
    _, hf_model, model = loaded
    reloaded = save_round_trips(torch, transformers, model, tmp_path, GEMMA4, SEQ)
    original, saved = hf_model.state_dict(), reloaded.state_dict()
    assert saved.keys() == original.keys()
    for name, weight in saved.items():
        np.testing.assert_array_equal(weight, original[name], err_msg=name)


def test_the_image_text_model_loads_as_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration (a one-block vision tower beside the text model of
    ple_shared, four layers): tfx.hf.load reads the text model, with the multimodal model's
    logits on text, and saves it as Gemma4ForCausalLM."""
    torch.manual_seed(0)
    text = {**BASE, **CASES["ple_shared"], "num_hidden_layers": 4, "layer_types": KINDS[:2] * 2}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4,
                  position_embedding_size=64)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    hf_model = perturb(torch, transformers.Gemma4ForConditionalGeneration(config).eval(), 0.3)
    with torch.no_grad():
        hf_model.model.language_model.embed_tokens.weight.mul_(0.05)
    hf_model.save_pretrained(tmp_path / "multimodal")
    model = tfx.hf.load(tmp_path / "multimodal")
    assert model.config.attention.shared_kv_layers == 2 and model.config.embeddings.tie
    assert_logits_match(torch, model, hf_model, SEQ)
    reloaded = save_round_trips(torch, transformers, model, tmp_path / "text", GEMMA4, SEQ)
    assert type(reloaded).__name__ == GEMMA4


def test_defaults_read_as_transformers_builds_them():
    c = gemma4.config_from_hf({"num_hidden_layers": 4}, GEMMA4)
    # Every sixth layer full, the last forced full; global_head_dim 512; proportional rope.
    assert c.attention.layer_types == ("sliding", "sliding", "sliding", "full")
    assert (c.attention.full_head_dim, c.attention.full_kv_heads) == (512, None)
    assert c.rope.scaling == ProportionalScaling(0.25) and c.rope.theta == 1e6
    assert (c.embeddings.per_layer_width, c.rope.local_theta) == (256, 1e4)
    hf = gemma4.config_to_hf(c, GEMMA4)
    assert gemma4.config_from_hf(hf, GEMMA4) == c
    config = transformers.Gemma4TextConfig(**{k: v for k, v in hf.items()
                                              if k not in ("architectures", "model_type")})
    assert config.per_layer_config[3].head_dim == 512
    assert "reuse" not in config.kv_sharing_modes  # no layer shares another's keys


@pytest.mark.parametrize("fields, match", [
    (dict(enable_moe_block=True), "enable_moe_block"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(layer_types=["chunked_attention"] * 5), "layer_types"),
    (dict(per_layer_config={"0": {"head_dim": 8}}), "per_layer_config"),
    (dict(per_layer_config={"1": {"head_dim": 32}, "4": {"head_dim": 64}}), "per_layer_config"),
    (dict(per_layer_config={"1": {"intermediate_size": 8}, "4": {"intermediate_size": 8}}),
     "per_layer_config"),
    (dict(rope_parameters={"full_attention": dict(rope_type="yarn", factor=2.0,
                                                  rope_theta=1.0),
                           "sliding_attention": dict(rope_type="default", rope_theta=1.0)}),
     "rope_type"),
    (dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1.0),
                           "sliding_attention": dict(rope_type="linear", factor=2.0,
                                                     rope_theta=1.0)}), "sliding_attention"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)), "layer type"),
])
def test_unsupported_hf_settings_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        gemma4.config_from_hf(dict(BASE, **fields), GEMMA4)


_TFX = gemma4.config_from_hf(BASE, GEMMA4)


@pytest.mark.parametrize("changes, match", [
    (dict(attention={"value_norm": False}), r"attention\.value_norm"),
    (dict(norm={"layer_scale": False}), r"norm\.layer_scale"),
    (dict(attention={"scale": None}), r"attention\.scale"),
    (dict(rope={"local_theta": None}), "rope.local_theta"),
    (dict(attention={"layer_types": ("full",) * 4 + ("sliding",)}), "last layer"),
])
def test_configs_transformers_cannot_express_raise(changes, match):
    with pytest.raises(ValueError, match=match):
        gemma4.config_to_hf(_TFX.replace(**changes), GEMMA4)
