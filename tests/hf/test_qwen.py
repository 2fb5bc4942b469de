"""Qwen2ForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM checkpoints: tfx.hf.load / save
against transformers (eager attention, float32).

Tiny random models (grouped-query attention), one feature set each:
- qwen2-window: biases on q, k, v only; sliding layers (window 4, narrower than the sequence)
  after max_window_layers=1 full one; head tied to the embeddings.
- qwen3-bias: per-head q/k RMSNorm, head_dim 16 with 4 heads (64 != hidden 32),
  attention_bias (q, k, v and o biases, none in the MLP).
- moe-renorm: 4 experts, top-2 renormalised (norm_topk_prob), mlp_only_layers=[0] (a leading
  dense layer of another width than the experts), experts in layers 1 and 2.
- moe-step2-window: top-2 probabilities as they are (norm_topk_prob false),
  decoder_sparse_step=2 (experts in layer 1 only), a window of 4 on every layer.
Inputs are a right-padded batch; logits are compared at the real positions. Greedy decoding
is compared token for token on left-padded prompts of different lengths.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from causal_lm_parity import (  # noqa: E402
    PROMPTS,
    assert_greedy_matches,
    assert_in_memory_layout_loads,
    hf_causal_lm,
    parity_tests,
    save_round_trips,
)

from tfx.hf import qwen  # noqa: E402
from tfx.models import DecoderConfig  # noqa: E402

QWEN2, QWEN3, MOE = "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
SEQ = 12
BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=100.0))
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
CASES = {
    "qwen2-window": (QWEN2, dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                                 max_window_layers=1, tie_word_embeddings=True)),
    "qwen3-bias": (QWEN3, dict(head_dim=16, attention_bias=True)),
    "moe-renorm": (MOE, dict(EXPERTS, num_hidden_layers=3, norm_topk_prob=True,
                             mlp_only_layers=[0])),
    "moe-step2-window": (MOE, dict(EXPERTS, norm_topk_prob=False, decoder_sparse_step=2,
                                   use_sliding_window=True, sliding_window=4)),
}


def _hf_model(case: str):
    architecture, overrides = CASES[case]
    return hf_causal_lm(torch, transformers, architecture, {**BASE, **overrides}, scale=0.3)


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    config = model.config
    attention = config.attention
    if case == "qwen2-window":
        assert (config.use_bias, attention.qkv_bias, attention.qk_norm) == (False, True, None)
        assert attention.sliding_window == 4
        assert attention.layer_types == ("full", "sliding", "sliding")
        assert config.embeddings.tie and config.moe is None
    else:
        assert attention.qk_norm == "per_head" and not config.embeddings.tie
        assert attention.layer_types is None
        assert attention.sliding_window == (4 if case.endswith("window") else None)
    if case == "qwen3-bias":
        assert (config.use_bias, attention.qkv_bias, attention.out_bias) == (False, True, True)
        assert attention.head_dim == 16
    if case.startswith("moe"):
        moe = config.moe
        assert (moe.num_experts, moe.experts_per_token, moe.d_ff, config.d_ff) == (4, 2, 16, 48)
        assert (moe.policy, moe.capacity_factor, moe.jitter) == ("topk", None, 0.0)
        assert (moe.renormalize, moe.first_dense, moe.every) == (
            (True, 1, 1) if case == "moe-renorm" else (False, 0, 2))


def test_save_round_trips_through_transformers(loaded, tmp_path):
    case, _, model = loaded
    save_round_trips(torch, transformers, model, tmp_path / "out", CASES[case][0], SEQ)


@pytest.mark.parametrize("loaded", ["qwen2-window"], indirect=True)
def test_greedy_generate_matches_transformers(loaded):
    """Prompts of 7, 3 and 5 tokens, 12 new tokens: past the window of the sliding layers,
    which HF decodes through sliding-window caches and tfx through window masks on its one
    linear cache."""
    _, hf_model, model = loaded
    out = assert_greedy_matches(torch, model, hf_model, PROMPTS, 12)
    assert [type(layer).__name__ for layer in out.cache.layers] == [
        "DynamicLayer", "DynamicSlidingWindowLayer", "DynamicSlidingWindowLayer"]


@pytest.mark.parametrize("loaded", ["qwen3-bias", "moe-renorm"], indirect=True)
def test_greedy_generate_of_qwen3_matches_transformers(loaded):
    """Qwen 3 (q/k norms, head_dim apart from the width, attention biases) and Qwen 3 MoE (a
    dense first layer, top-2 renormalised experts): the same tokens."""
    _, hf_model, model = loaded
    assert_greedy_matches(torch, model, hf_model, PROMPTS, 8)


@pytest.mark.parametrize("loaded", ["moe-renorm"], indirect=True)
def test_fused_experts_load_like_per_expert(loaded, tmp_path):
    """transformers 5's in-memory names (experts fused [E, 2f, d], gate rows first) give the
    same parameters as the per-expert tensors save_pretrained writes."""
    _, hf_model, model = loaded
    assert_in_memory_layout_loads(hf_model, model, tmp_path / "fused", MOE,
                                  "model.layers.1.mlp.experts.gate_up_proj")


def test_train_settings_weigh_the_balancing_loss_like_mixtral():
    # HF's aux loss scores a balanced router k (2), tfx's 1; 0 without output_router_logits.
    settings = qwen.train_settings(dict(BASE, **EXPERTS, output_router_logits=True,
                                        router_aux_loss_coef=0.02))
    assert settings == {"load_balancing_weight": pytest.approx(0.04), "router_z_weight": 0.0}
    assert qwen.train_settings(BASE)["load_balancing_weight"] == 0.0


@pytest.mark.parametrize("architecture", [QWEN2, QWEN3, MOE])
def test_config_defaults_are_the_config_classes(architecture):
    minimal = dict(vocab_size=99, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=32)
    config = qwen.config_from_hf(minimal, architecture)
    reference = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**minimal)
    head_dim = getattr(reference, "head_dim", None)
    assert config.attention.head_dim == head_dim  # Qwen 3: 128, not 64 // 32; others: none
    assert config.kv_heads == reference.num_key_value_heads
    assert config.norm.eps == reference.rms_norm_eps
    assert config.rope.theta == reference.rope_parameters["rope_theta"]
    assert config.attention.sliding_window is None and config.max_len == 32768
    if architecture == MOE:
        moe = config.moe
        assert (moe.num_experts, moe.experts_per_token) == (reference.num_experts,
                                                            reference.num_experts_per_tok)
        assert (moe.d_ff, moe.renormalize) == (reference.moe_intermediate_size, False)


@pytest.mark.parametrize("step, mlp_only, every, first_dense", [
    (1, [], 1, 0), (2, None, 2, 0),
    (2, [0], 2, 0),  # layer 0 is dense at step 2 anyway
    (1, [0, 1], 1, 2), (2, [1], 2, 2),  # layers 0-2 dense, then 3, 5
])
def test_mlp_only_layers_as_leading_dense_layers(step, mlp_only, every, first_dense):
    hf = dict(BASE, **EXPERTS, num_hidden_layers=6, decoder_sparse_step=step,
              mlp_only_layers=mlp_only)
    moe = qwen.config_from_hf(hf, MOE).moe
    assert (moe.every, moe.first_dense) == (every, first_dense)


@pytest.mark.parametrize("architecture, fields, match", [
    (QWEN2, dict(hidden_act="gelu"), "hidden_act"),
    (QWEN2, dict(layer_types=["full_attention", "chunked_attention"]), "layer_types"),
    (QWEN3, dict(layer_types=["full_attention", "sliding_attention"]), "use_sliding_window"),
    (QWEN3, dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "rope_type"),
    (MOE, dict(EXPERTS, mlp_only_layers=[1]), "mlp_only_layers"),  # dense after experts
    (MOE, dict(EXPERTS, decoder_sparse_step=3), "no layer has experts"),
    (MOE, dict(EXPERTS, num_experts=0), "num_experts"),
    (MOE, dict(EXPERTS, num_experts_per_tok=5), "num_experts_per_tok"),
])
def test_unsupported_hf_settings_raise(architecture, fields, match):
    with pytest.raises(ValueError, match=match):
        qwen.config_from_hf(dict(BASE, **fields), architecture)


_TFX = DecoderConfig(vocab_size=99, d_model=32, num_layers=2, num_heads=4, d_ff=48,
                     position="rope", norm={"kind": "rms"},
                     mlp={"activation": "silu", "gated": True}, use_bias=False)
_QWEN3 = _TFX.replace(attention={"qk_norm": "per_head"})
_MOE = _QWEN3.replace(moe={"num_experts": 4, "experts_per_token": 2})


@pytest.mark.parametrize("architecture, config, match", [
    (QWEN2, _TFX, "qkv_bias"),  # Qwen 2 has q, k, v biases
    (QWEN2, _TFX.replace(attention={"qkv_bias": True, "qk_norm": "per_head"}), "qk_norm"),
    (QWEN3, _TFX, "qk_norm"),
    (QWEN3, _QWEN3.replace(attention={"qkv_bias": True}), "out_bias"),
    (QWEN3, _QWEN3.replace(use_bias=True), "use_bias"),  # MLP biases
    (QWEN3, _QWEN3.replace(norm={"outputs": True}), r"norm\.outputs"),
    (QWEN3, _MOE, "num_experts=4"),
    (MOE, _QWEN3, "needs experts"),
    (MOE, _MOE.replace(attention={"sliding_window": 4, "layer_types": ("full", "sliding")}),
     "layer_types"),
    (MOE, _MOE.replace(moe={"policy": "deepseek"}), r"moe\.policy"),
    (MOE, _MOE.replace(moe={"shared_experts": 1}), r"moe\.shared_experts"),
    (MOE, _MOE.replace(moe={"capacity_factor": 1.25}), r"moe\.capacity_factor"),
])
def test_configs_qwen_cannot_express_raise(architecture, config, match):
    with pytest.raises(ValueError, match=match):
        qwen.config_to_hf(config, architecture)
