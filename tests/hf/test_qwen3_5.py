"""Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM checkpoints: tfx.hf.load / save against
transformers (eager attention, float32).

Tiny random Qwen3.5 text models (width 32; full layers of 4 query and 2 key/value heads of 16,
each gating its output, a quarter of each head rotated through transformers' multimodal rotary
sections; Gated DeltaNet layers of 4 value heads of 6 and 2 key heads of 8 with separate
in_proj_qkv / z / b / a; every weight perturbed so that the (1 + weight) norms and gates
matter):

- dense: linear, full, linear, linear layers, SwiGLU MLPs of width 48, an untied head.
- moe: the default layer kinds of four layers (three linear, then full), experts in every
  layer (top-2 of 4, width 16, always renormalised) and a gated shared expert two experts
  wide, a tied head.

Each: logits on a right-padded and on a left-padded batch at the real positions, greedy
`tfx.generate` token for token as HF's generate on left-padded prompts of different lengths,
`tfx.hf.save` read back by transformers. Then the named sizes, and what is refused.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from causal_lm_parity import (  # noqa: E402
    PROMPTS,
    assert_close_where_real,
    assert_greedy_matches,
    hf_causal_lm,
    left_padded,
    parity_tests,
    save_round_trips,
    tfx_logits,
    torch_logits,
)
from flax import nnx  # noqa: E402

from tfx.hf import io, qwen3_5  # noqa: E402
from tfx.models import create, families  # noqa: E402

DENSE, MOE = "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"
SEQ, NEW = 12, 8
BASE = dict(vocab_size=99, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=6,
            max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=None)
CASES = {
    "dense": (DENSE, dict(intermediate_size=48, layer_types=[
        "linear_attention", "full_attention", "linear_attention", "linear_attention"])),
    "moe": (MOE, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, tie_word_embeddings=True)),
}
_CONFIG_CLASSES = {DENSE: "Qwen3_5TextConfig", MOE: "Qwen3_5MoeTextConfig"}
# Seeds whose greedy continuations visit several tokens (tiny random models often repeat one).
_SEEDS = {"moe": 1}


def _hf_model(case: str):
    architecture, fields = CASES[case]
    return hf_causal_lm(torch, transformers, architecture, {**BASE, **fields},
                        seed=_SEEDS.get(case, 0), scale=0.1,
                        config_class=getattr(transformers, _CONFIG_CLASSES[architecture]))


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    c = model.config
    architecture = CASES[case][0]
    assert qwen3_5.CARDS[architecture].mismatches(c) == {}
    assert c.attention.output_gate and c.rope.fraction == 0.25
    assert (c.linear.heads, c.linear.key_heads, c.linear.key_dim, c.linear.value_dim) == (
        4, 2, 8, 6)
    if case == "dense":
        assert c.attention.layer_types == ("linear", "full", "linear", "linear")
        assert c.moe is None and c.d_ff == 48 and not c.embeddings.tie
    else:
        assert c.attention.layer_types == ("linear",) * 3 + ("full",) and c.embeddings.tie
        assert (c.moe.num_experts, c.moe.experts_per_token, c.moe.d_ff, c.moe.shared_experts,
                c.moe.shared_gate, c.moe.renormalize) == (4, 2, 16, 2, True, True)


def test_logits_match_transformers_on_a_left_padded_batch(loaded):
    _, hf_model, model = loaded
    ids, mask = left_padded([[5, 17, 42, 8, 33, 71, 12, 9, 64, 3, 22], [7, 90, 51, 14, 60]])
    assert_close_where_real(tfx_logits(model, ids, mask),
                            torch_logits(torch, hf_model, ids, mask), mask)


def test_greedy_generation_matches_transformers(loaded):
    _, hf_model, model = loaded
    assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)


def test_save_round_trips_through_transformers(loaded, tmp_path):
    case, _, model = loaded
    save_round_trips(torch, transformers, model, tmp_path, CASES[case][0], SEQ)


def test_separate_projections_map_one_to_one():
    """in_proj_qkv stacks the query, key and value rows; z, b and a are the gate, β and decay
    projections; the saved tensors load back exactly."""
    config = qwen3_5.config_from_hf({**BASE, **CASES["dense"][1]}, DENSE)
    params = io.flat_params(create(config, rngs=nnx.Rngs(0)))
    tensors = qwen3_5.params_to_hf(params, config)
    attention, hf = ("stack", "layers", 0, "attention"), "model.layers.0.linear_attn"
    qkv = tensors[f"{hf}.in_proj_qkv.weight"]
    assert qkv.shape == (2 * 16 + 24, 32)
    np.testing.assert_array_equal(qkv[16:32], params[(*attention, "key", "kernel")].T)
    for letter, name in zip("zba", ("gate", "beta", "decay"), strict=True):
        np.testing.assert_array_equal(tensors[f"{hf}.in_proj_{letter}.weight"],
                                      params[(*attention, name, "kernel")].T)
    np.testing.assert_array_equal(tensors[f"{hf}.conv1d.weight"][:, 0].T,
                                  params[(*attention, "conv")])
    back = qwen3_5.params_from_hf(tensors, config)
    assert back.keys() == params.keys()
    for path in params:
        np.testing.assert_allclose(back[path], params[path], rtol=0, atol=1e-7,
                                   err_msg=str(path))


# The text configs of Qwen/Qwen3.5-27B and Qwen/Qwen3.5-35B-A3B (the fields that size them).
_PUBLIC_COMMON = dict(vocab_size=248320, head_dim=256, hidden_act="silu",
                      linear_conv_kernel_dim=4, linear_key_head_dim=128,
                      linear_num_key_heads=16, linear_value_head_dim=128,
                      max_position_embeddings=262144, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, attention_bias=False,
                      rope_parameters=dict(rope_type="default", rope_theta=10000000,
                                           partial_rotary_factor=0.25,
                                           mrope_section=[11, 11, 10], mrope_interleaved=True))
PUBLIC = {
    "qwen3.5-27b": (DENSE, dict(_PUBLIC_COMMON, hidden_size=5120, intermediate_size=17408,
                                num_hidden_layers=64, num_attention_heads=24,
                                num_key_value_heads=4, linear_num_value_heads=48)),
    "qwen3.5-35b-a3b": (MOE, dict(_PUBLIC_COMMON, hidden_size=2048, num_hidden_layers=40,
                                  num_attention_heads=16, num_key_value_heads=2,
                                  linear_num_value_heads=32, num_experts=256,
                                  num_experts_per_tok=8, moe_intermediate_size=512,
                                  shared_expert_intermediate_size=512)),
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_public_text_configs_read_as_their_named_sizes(name):
    architecture, hf = PUBLIC[name]
    config = qwen3_5.config_from_hf(hf, architecture)
    assert families.canonical(config) == families.canonical(families.size_config(name))


@pytest.mark.parametrize("architecture, fields, match", [
    (DENSE, dict(layer_types=["full_attention"] * 4), "no linear_attention layer"),
    (DENSE, dict(hidden_act="gelu"), "hidden_act"),
    (MOE, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=8),
     "shared_expert_intermediate_size=8"),
    (MOE, dict(num_experts=4, num_experts_per_tok=6), "num_experts_per_tok"),
])
def test_unsupported_hf_settings_raise(architecture, fields, match):
    with pytest.raises(ValueError, match=match):
        qwen3_5.config_from_hf({**BASE, **fields}, architecture)


_DENSE = qwen3_5.config_from_hf({**BASE, **CASES["dense"][1]}, DENSE)
_MOE = qwen3_5.config_from_hf({**BASE, **CASES["moe"][1]}, MOE)


@pytest.mark.parametrize("config, architecture, match", [
    (_DENSE.replace(attention={"output_gate": False}), DENSE, r"attention\.output_gate=False"),
    (_MOE, DENSE, r"moe \(it has none\)"),
    (_DENSE, MOE, r"moe=None"),
    (_MOE.replace(moe={"every": 2}), MOE, r"moe\.every=2"),
    (_MOE.replace(moe={"renormalize": False}), MOE, r"moe\.renormalize=False"),
])
def test_configs_qwen3_5_cannot_express_raise(config, architecture, match):
    with pytest.raises(ValueError, match=match):
        qwen3_5.config_to_hf(config, architecture)
