"""Olmo3ForCausalLM checkpoints: tfx.hf.load / save against transformers (eager attention,
float32).

Tiny random OLMo 3 models (width 32, 4 heads of 8, two layers, a window of 4 tokens, narrower
than the sequences: the decode goes past it; weights perturbed so that norms and biases matter):

- yarn-full: a sliding then a full layer, grouped-query attention (2 key/value heads),
  attention_bias, YaRN on the full layer only and a rope_theta of its own on the sliding one
  (the long-context checkpoints' layout: rope.scaling with rope.local_theta).
- equal-rope: a full then a sliding layer, one linear-scaled rope for both kinds (rope.scaling
  alone), a tied head.

Each: logits on a right-padded batch at the real positions, greedy `tfx.generate` token for
token as HF's generate on left-padded prompts of different lengths (no EOS on either side),
`tfx.hf.save` read back by transformers (same logits, same config back). Then how config.json
files read (as transformers' Olmo3Config resolves them; the public 7B's), and what is refused.
"""

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

from tfx.hf import olmo3  # noqa: E402
from tfx.models import families  # noqa: E402
from tfx.ops.positional import LinearScaling, YaRNScaling  # noqa: E402

OLMO3 = "Olmo3ForCausalLM"
SEQ, NEW = 12, 10
FIELDS = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6,
              pad_token_id=0, eos_token_id=None, sliding_window=4)
_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
             attention_factor=1.2, rope_theta=100.0)
_LINEAR = dict(rope_type="linear", factor=2.0, rope_theta=100.0)
CASES = {
    "yarn-full": dict(FIELDS, num_key_value_heads=2, attention_bias=True,
                      layer_types=["sliding_attention", "full_attention"],
                      rope_parameters={"full_attention": _YARN,
                                       "sliding_attention": dict(rope_type="default",
                                                                 rope_theta=1000.0)}),
    "equal-rope": dict(FIELDS, tie_word_embeddings=True,
                       layer_types=["full_attention", "sliding_attention"],
                       rope_parameters={"full_attention": _LINEAR,
                                        "sliding_attention": _LINEAR}),
}
# A seed whose greedy continuations visit several tokens in both cases (tiny random models often
# repeat one).
_SEED = 2


def _hf_model(case: str):
    return hf_causal_lm(torch, transformers, OLMO3, CASES[case], seed=_SEED, scale=0.3)


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    c = model.config
    assert families.OLMO3.mismatches(c) == {}
    assert c.attention.sliding_window == 4
    if case == "yarn-full":
        assert c.attention.layer_types == ("sliding", "full") and c.kv_heads == 2
        assert c.rope.theta == 100.0 and c.rope.local_theta == 1000.0
        assert c.rope.scaling == YaRNScaling(4.0, 16, attention_factor=1.2)
        assert (c.attention.qkv_bias, c.attention.out_bias) == (True, True)
    else:
        assert c.attention.layer_types == ("full", "sliding") and c.embeddings.tie
        assert c.rope.theta == 100.0 and c.rope.local_theta is None
        assert c.rope.scaling == LinearScaling(2.0)


def test_greedy_generation_matches_transformers(loaded):
    _, hf_model, model = loaded
    assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)


def test_save_round_trips_through_transformers(loaded, tmp_path):
    _, _, model = loaded
    save_round_trips(torch, transformers, model, tmp_path, OLMO3, SEQ)


@pytest.mark.parametrize("fields", [
    {}, dict(num_hidden_layers=6), dict(rope_theta=1000.0),
    dict(rope_theta=1000.0, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                              original_max_position_embeddings=512)),
    dict(rope_scaling=dict(type="linear", factor=2.0)),
    dict(rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0)}),
], ids=["default", "six-layers", "legacy-theta", "legacy-yarn", "legacy-type", "full-only"])
def test_config_json_reads_as_transformers_resolves_it(fields):
    """Layer kinds and each kind's rope_theta as Olmo3Config resolves them (a top-level
    rope_theta reaches the full layers only; the default pattern is three sliding, one full)."""
    config = olmo3.config_from_hf(fields, OLMO3)  # first: Olmo3Config updates the dicts
    hf = transformers.Olmo3Config(**fields, eos_token_id=None)
    assert [f"{kind}_attention" for kind in config.attention.layer_types] == hf.layer_types
    full, sliding = (hf.rope_parameters[kind] for kind in ("full_attention", "sliding_attention"))
    assert config.rope.theta == full["rope_theta"]
    assert (config.rope.scaling is None) == (full["rope_type"] == "default")
    assert config.rope.local_theta == (None if _rotation(sliding) == _rotation(full)
                                       else sliding["rope_theta"])


def _rotation(settings: dict) -> dict:
    """What of a layer type's resolved rope settings rotates: a default rope's theta alone (the
    other fields are ignored), a scaled rope's every field."""
    return settings if settings["rope_type"] != "default" else {"theta": settings["rope_theta"]}


def test_the_public_7b_config_json_reads_as_its_size_with_yarn_on_the_full_layers():
    """allenai/Olmo-3-1025-7B's config.json: olmo3-7b stretched to 65536 tokens by YaRN on its
    full layers, its sliding layers unscaled."""
    hf = dict(vocab_size=100278, hidden_size=4096, intermediate_size=11008,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
              max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=500000,
              sliding_window=4096, tie_word_embeddings=False, pad_token_id=100277,
              attention_bias=False, hidden_act="silu",
              rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8192,
                                attention_factor=1.2079441541679836, beta_fast=32, beta_slow=1))
    yarn = YaRNScaling(8.0, 8192, attention_factor=1.2079441541679836)
    expected = families.size_config("olmo3-7b").replace(
        max_len=65536, rope={"scaling": yarn, "local_theta": 500000.0})
    config = olmo3.config_from_hf(hf, OLMO3)
    assert families.canonical(config) == families.canonical(expected)


@pytest.mark.parametrize("fields, match", [
    (dict(sliding_window=None), "sliding_window=None"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(rope_parameters=dict(rope_type="linear", factor=2.0)), "keyed by layer type"),
    (dict(rope_parameters={"sliding_attention": _LINEAR}), r"\['sliding_attention'\]"),
    (dict(rope_parameters={"full_attention": dict(rope_type="longrope")}), "rope_type"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(hidden_act="relu"), "hidden_act"),
])
def test_unsupported_hf_settings_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        olmo3.config_from_hf(dict(FIELDS, **fields), OLMO3)


_SMALL = olmo3.config_from_hf(FIELDS, OLMO3)


@pytest.mark.parametrize("config, match", [
    (_SMALL.replace(attention={"sliding_window": None, "layer_types": ("full", "full")}),
     "needs attention.sliding_window"),
    (_SMALL.replace(norm={"inputs": True}), r"norm\.inputs"),
    (_SMALL.replace(attention={"qk_norm": "per_head"}), r"qk_norm"),
    (_SMALL.replace(rope={"fraction": 0.5}), r"rope\.fraction"),
])
def test_configs_transformers_cannot_express_raise(config, match):
    with pytest.raises(ValueError, match=match):
        olmo3.config_to_hf(config, OLMO3)
