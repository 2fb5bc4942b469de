"""SmolLM3ForCausalLM checkpoints: tfx.hf.load / save against transformers (eager attention,
float32).

Tiny random SmolLM3 models (width 32, 4 heads of 8, grouped-query attention): layers whose
no_rope_layers flag is 0 encode no positions (NoPE), rope.nope_layers in tfx.

- default: four layers, no_rope_layers absent (SmolLM3Config's every fourth layer: layer 3).
- listed: three layers with an explicit list (layer 0 without rope), biases, a tied head.

Each: logits on a right-padded batch at the real positions, greedy `tfx.generate` token for
token as HF's generate on left-padded prompts of different lengths (no EOS on either side),
`tfx.hf.save` read back by transformers (same logits). Then what is refused.
"""

from __future__ import annotations

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

from tfx.hf import smollm3  # noqa: E402
from tfx.models import families  # noqa: E402

SMOLLM3 = "SmolLM3ForCausalLM"
SEQ, NEW = 12, 10
FIELDS = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rope_theta=100.0,
              pad_token_id=0, eos_token_id=None, bos_token_id=None)
CASES = {
    "default": dict(FIELDS, num_hidden_layers=4, tie_word_embeddings=False),
    "listed": dict(FIELDS, num_hidden_layers=3, no_rope_layers=[0, 1, 1],
                   attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
}
NOPE = {"default": (3,), "listed": (0,)}


def _hf_model(case: str):
    return hf_causal_lm(torch, transformers, SMOLLM3, CASES[case], seed=1, scale=0.3)


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    assert families.SMOLLM3.mismatches(model.config) == {}
    assert model.config.rope.nope_layers == NOPE[case]
    assert [model.config.has_positions(i) for i in range(model.config.num_layers)] == [
        i not in NOPE[case] for i in range(model.config.num_layers)]


def test_greedy_generation_matches_transformers(loaded):
    _, hf_model, model = loaded
    assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)


def test_save_round_trips_through_transformers(loaded, tmp_path):
    _, _, model = loaded
    save_round_trips(torch, transformers, model, tmp_path, SMOLLM3, SEQ)


@pytest.mark.parametrize("fields, match", [
    (dict(use_sliding_window=True, sliding_window=4,
          layer_types=["sliding_attention", "full_attention"]), "use_sliding_window"),
    (dict(no_rope_layers=[1, 1, 0]), "no_rope_layers must be 2 flags"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True, mlp_bias=False), "differ"),
])
def test_unsupported_settings_are_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        smollm3.config_from_hf(dict(FIELDS, num_hidden_layers=2, **fields), SMOLLM3)
