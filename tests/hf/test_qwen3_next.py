"""Qwen3NextForCausalLM checkpoints: tfx.hf.load / save against transformers (eager attention,
float32).

Tiny random Qwen3-Next models (width 32; full layers of 4 query and 2 key/value heads of 16,
each gating its output; Gated DeltaNet layers of 4 value heads of 6 and 2 key heads of 8;
experts of width 16 with a gated shared expert; every weight perturbed so that the (1 + weight)
norms, gates and biases matter):

- sparse: linear, full, linear, full layers (layer_types); layer 0 dense (mlp_only_layers),
  experts in the others, top-2 of 4 without renormalisation, a shared expert two experts wide,
  the default quarter of each head rotated, an untied head.
- biased: linear, full, linear, full layers (full_attention_interval 2), experts every second
  layer (decoder_sparse_step 2), attention_bias (q with its gate, k, v and o), half of each
  head rotated with rope_theta 100, a tied head.

Each: logits on a right-padded and on a left-padded batch at the real positions (transformers
reads padding as zeros in the linear layers; so does tfx), greedy `tfx.generate` token for
token as HF's generate (its hybrid cache) on left-padded prompts of different lengths,
`tfx.hf.save` read back by transformers. Then the named size, and what is refused.
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

from tfx.hf import io, qwen3_next  # noqa: E402
from tfx.models import create, families  # noqa: E402

QWEN3_NEXT = "Qwen3NextForCausalLM"
SEQ, NEW = 12, 8
BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=6, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=32,
            max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=None)
CASES = {
    "sparse": dict(layer_types=["linear_attention", "full_attention"] * 2, mlp_only_layers=[0],
                   norm_topk_prob=False),
    "biased": dict(full_attention_interval=2, decoder_sparse_step=2, attention_bias=True,
                   rope_parameters=dict(rope_type="default", rope_theta=100.0,
                                        partial_rotary_factor=0.5),
                   tie_word_embeddings=True),
}


def _hf_model(case: str):
    return hf_causal_lm(torch, transformers, QWEN3_NEXT, {**BASE, **CASES[case]}, scale=0.1)


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    c = model.config
    assert families.QWEN3_NEXT.mismatches(c) == {}
    assert c.attention.layer_types == ("linear", "full") * 2 and c.attention.output_gate
    assert (c.linear.heads, c.linear.key_heads, c.linear.key_dim, c.linear.value_dim,
            c.linear.kernel_size) == (4, 2, 8, 6, 4)
    moe = c.moe
    assert (moe.num_experts, moe.experts_per_token, moe.d_ff, moe.shared_experts,
            moe.shared_gate) == (4, 2, 16, 2, True)
    if case == "sparse":
        assert (moe.every, moe.first_dense, moe.renormalize) == (1, 1, False)
        assert c.rope.fraction == 0.25 and not c.embeddings.tie
        assert not c.attention.qkv_bias
    else:
        assert (moe.every, moe.first_dense, moe.renormalize) == (2, 0, True)
        assert (c.rope.fraction, c.rope.theta) == (0.5, 100.0) and c.embeddings.tie
        assert c.attention.qkv_bias and c.attention.out_bias


def test_logits_match_transformers_on_a_left_padded_batch(loaded):
    _, hf_model, model = loaded
    ids, mask = left_padded([[5, 17, 42, 8, 33, 71, 12, 9, 64, 3, 22], [7, 90, 51, 14, 60]])
    assert_close_where_real(tfx_logits(model, ids, mask),
                            torch_logits(torch, hf_model, ids, mask), mask)


def test_greedy_generation_matches_transformers(loaded):
    _, hf_model, model = loaded
    assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)


def test_save_round_trips_through_transformers(loaded, tmp_path):
    _, _, model = loaded
    save_round_trips(torch, transformers, model, tmp_path, QWEN3_NEXT, SEQ)


def test_q_proj_holds_each_heads_query_then_its_gate_and_norms_shift_by_one():
    """q_proj's rows per head are [query | gate]; a norm's weight is its scale minus one; the
    Gated DeltaNet's fused projections split and merge back exactly; `mtp.*` is not read."""
    config = qwen3_next.config_from_hf({**BASE, **CASES["biased"]}, QWEN3_NEXT)
    params = io.flat_params(create(config, rngs=nnx.Rngs(0)))
    tensors = qwen3_next.params_to_hf(params, config)
    attention = ("stack", "layers", 1, "attention")
    q_proj = tensors["model.layers.1.self_attn.q_proj.weight"].reshape(4, 2, 16, 32)
    np.testing.assert_array_equal(q_proj[:, 0].reshape(64, 32),
                                  params[(*attention, "query", "kernel")].T)
    np.testing.assert_array_equal(q_proj[:, 1].reshape(64, 32),
                                  params[(*attention, "gate", "kernel")].T)
    bias = tensors["model.layers.1.self_attn.q_proj.bias"].reshape(4, 2, 16)
    np.testing.assert_array_equal(bias[:, 1].reshape(64), params[(*attention, "gate", "bias")])
    np.testing.assert_array_equal(tensors["model.norm.weight"],
                                  params[("stack", "final_norm", "scale")] - 1)
    # The hub checkpoints' multi-token-prediction head, which transformers does not read either.
    back = qwen3_next.params_from_hf({**tensors, "mtp.fc.weight": np.zeros((32, 64))}, config)
    assert back.keys() == params.keys()
    for path in params:
        np.testing.assert_allclose(back[path], params[path], rtol=0, atol=1e-7,
                                   err_msg=str(path))


# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (the fields that size the model).
PUBLIC_80B = dict(
    architectures=[QWEN3_NEXT], attention_bias=False, decoder_sparse_step=1,
    full_attention_interval=4, head_dim=256, hidden_act="silu", hidden_size=2048,
    intermediate_size=5120, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_value_head_dim=128,
    max_position_embeddings=262144, mlp_only_layers=[], model_type="qwen3_next",
    moe_intermediate_size=512, norm_topk_prob=True, num_attention_heads=16, num_experts=512,
    num_experts_per_tok=10, num_hidden_layers=48, num_key_value_heads=2,
    partial_rotary_factor=0.25, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=10000000,
    shared_expert_intermediate_size=512, tie_word_embeddings=False, vocab_size=151936)


def test_the_public_config_reads_as_its_named_size():
    config = qwen3_next.config_from_hf(PUBLIC_80B, QWEN3_NEXT)
    expected = families.size_config("qwen3-next-80b-a3b")
    assert families.canonical(config) == families.canonical(expected)


def test_config_json_reads_as_transformers_resolves_it():
    """Defaults (layer kinds, rotary fraction) as Qwen3NextConfig fills them in."""
    fields = dict(num_hidden_layers=8, full_attention_interval=4)
    config = qwen3_next.config_from_hf(fields, QWEN3_NEXT)
    hf = transformers.Qwen3NextConfig(**fields)
    assert [f"{kind}_attention" for kind in config.attention.layer_types] == hf.layer_types
    assert config.rope.fraction == hf.rope_parameters["partial_rotary_factor"]
    assert config.rope.theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("fields, match", [
    (dict(layer_types=["full_attention"] * 4), "no linear_attention layer"),
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types"),
    (dict(layer_types=["linear_attention"] * 3), "layer_types"),
    (dict(shared_expert_intermediate_size=24), "shared_expert_intermediate_size=24"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(decoder_sparse_step=8), "no layer has experts"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1.0)), "rope_type='longrope'"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
])
def test_unsupported_hf_settings_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        qwen3_next.config_from_hf({**BASE, **fields}, QWEN3_NEXT)


_CONFIG = qwen3_next.config_from_hf(BASE, QWEN3_NEXT)


@pytest.mark.parametrize("changes, match", [
    (dict(attention={"output_gate": False}), r"attention\.output_gate=False"),
    (dict(moe={"shared_gate": False}), r"moe\.shared_gate=False"),
    (dict(moe={"capacity_factor": 1.0}), r"moe\.capacity_factor=1\.0"),
    (dict(moe=None), r"moe=None"),
    (dict(attention={"qk_norm": None}), r"attention\.qk_norm=None"),
    (dict(linear=None, attention={"layer_types": None}), r"linear=None"),
])
def test_configs_qwen3_next_cannot_express_raise(changes, match):
    with pytest.raises(ValueError, match=match):
        qwen3_next.config_to_hf(_CONFIG.replace(**changes), QWEN3_NEXT)
