"""MixtralForCausalLM checkpoints: tfx.hf.load / save against transformers (eager attention,
float32).

Tiny random models (4 experts, top-2, two layers, grouped-query attention) cover untied and
tied heads, a sliding window narrower than the sequence, and top-3 routing. Inputs are a
right-padded batch; logits are compared at the real positions. Checkpoints are read both as
save_pretrained writes them (one tensor per expert, `block_sparse_moe`) and in transformers 5's
fused in-memory layout (`mlp.experts.gate_up_proj` / `down_proj`).
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from causal_lm_parity import (  # noqa: E402
    assert_in_memory_layout_loads,
    assert_logits_match,
    hf_causal_lm,
    parity_tests,
    save_round_trips,
)

import tfx.hf  # noqa: E402
from tfx.hf import io, mixtral  # noqa: E402
from tfx.models import DecoderConfig, create  # noqa: E402

MIXTRAL = "MixtralForCausalLM"
SEQ = 12
BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=100.0))
CASES = {
    "gqa-untied": dict(),
    "window": dict(sliding_window=4, head_dim=16),  # narrower than SEQ; heads · 16 != d_model
    "tied-top3": dict(tie_word_embeddings=True, num_experts_per_tok=3,
                      output_router_logits=True, router_aux_loss_coef=0.02),
}


def _hf_model(case: str):
    return hf_causal_lm(torch, transformers, MIXTRAL, {**BASE, **CASES[case]})


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    config = model.config
    assert (config.moe.num_experts, config.moe.every, config.moe.capacity_factor) == (4, 1, None)
    assert config.moe.experts_per_token == (3 if case == "tied-top3" else 2)
    assert config.moe.policy == "topk" and config.moe.d_ff == config.d_ff == 24
    assert config.attention.sliding_window == (4 if case == "window" else None)
    assert config.embeddings.tie == (case == "tied-top3")
    assert config.kv_heads == 2 and config.rope.theta == 100.0
    # HF's aux loss scores a balanced router k, tfx's 1: the weight is scaled by k = 3, and is 0
    # where HF adds no aux loss (output_router_logits false). A training setting in tfx.
    settings = mixtral.train_settings({**BASE, **CASES[case]})
    assert settings["load_balancing_weight"] == pytest.approx(0.06 if case == "tied-top3" else 0.0)
    assert settings["router_z_weight"] == 0.0 and config.moe.jitter == 0.0


def test_save_round_trips_through_transformers(loaded, tmp_path):
    _, _, model = loaded
    reloaded = save_round_trips(torch, transformers, model, tmp_path / "out", MIXTRAL, SEQ)
    # The loss weight is a training setting, not the model's: a save writes Mixtral's default.
    assert reloaded.config.router_aux_loss_coef == pytest.approx(0.001)
    assert not reloaded.config.output_router_logits


def test_fused_layout_loads_like_per_expert(loaded, tmp_path):
    """transformers 5's own parameter names (router at mlp.gate, experts fused [E, 2f, d] with
    the gate rows first) give the same model as the per-expert files."""
    _, hf_model, model = loaded
    assert_in_memory_layout_loads(hf_model, model, tmp_path / "fused", MIXTRAL,
                                  "model.layers.0.mlp.experts.gate_up_proj")


@pytest.mark.parametrize("loaded", ["gqa-untied"], indirect=True)
def test_scan_layers_loads_and_saves_stacked_experts(loaded, tmp_path):
    _, hf_model, model = loaded
    hf_model.save_pretrained(tmp_path / "hf")
    scanned = tfx.hf.load(tmp_path / "hf", compute={"scan_layers": True})
    assert io.flat_params(scanned)[("stack", "layers", "mlp", "experts", "gate")].shape == (
        2, 4, 32, 24)  # [layers, E, d_model, f]
    assert_logits_match(torch, scanned, hf_model, SEQ)
    tfx.hf.save(scanned, tmp_path / "out", architecture=MIXTRAL)
    assert_logits_match(torch, model, transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval(), SEQ)


def test_config_defaults_are_mixtrals():
    """A config.json that leaves fields out gets MixtralConfig's defaults (rope_theta 1e6,
    rms_norm_eps 1e-5, 8 experts, top-2), not Llama's."""
    minimal = dict(vocab_size=99, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                   num_attention_heads=16)
    config = mixtral.config_from_hf(minimal, MIXTRAL)
    reference = transformers.MixtralConfig(**minimal)
    assert config.rope.theta == reference.rope_parameters["rope_theta"] == 1e6
    assert config.norm.eps == reference.rms_norm_eps
    assert config.moe.num_experts == reference.num_local_experts
    assert config.moe.experts_per_token == reference.num_experts_per_tok
    assert config.kv_heads == reference.num_key_value_heads
    assert config.attention.sliding_window is None


@pytest.mark.parametrize("fields, match", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(num_experts_per_tok=1), "num_experts_per_tok"),  # HF weights the one expert by 1
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "rope_type"),
])
def test_unsupported_hf_settings_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        mixtral.config_from_hf(dict(BASE, **fields), MIXTRAL)


_TFX = DecoderConfig(vocab_size=99, d_model=32, num_layers=1, num_heads=4, d_ff=24,
                     position="rope", norm={"kind": "rms"},
                     mlp={"activation": "silu", "gated": True}, use_bias=False,
                     moe={"num_experts": 4, "experts_per_token": 2})


@pytest.mark.parametrize("changes, match", [
    (dict(moe=None), "needs experts"),
    (dict(moe={"every": 2}, num_layers=2), r"moe\.every"),
    (dict(moe={"first_dense": 1}, num_layers=2), r"moe\.first_dense"),
    (dict(moe={"renormalize": False}), r"moe\.renormalize"),
    (dict(moe={"routed_scale": 2.5}), r"moe\.routed_scale"),
    (dict(moe={"capacity_factor": 1.25}), r"moe\.capacity_factor"),
    (dict(moe={"policy": "gshard"}), r"moe\.policy"),
    (dict(moe={"experts_per_token": 1}), r"moe\.experts_per_token"),
    (dict(use_bias=True), "use_bias"),
    (dict(mlp={"activation": "gelu"}), r"mlp\.activation"),
])
def test_configs_mixtral_cannot_express_raise(changes, match):
    with pytest.raises(ValueError, match=match):
        mixtral.config_to_hf(_TFX.replace(**changes), MIXTRAL)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MistralForCausalLM",
                                          "GPT2LMHeadModel"])
def test_dense_families_refuse_experts(tmp_path, architecture):
    with pytest.raises(ValueError, match="cannot express num_experts=4"):
        tfx.hf.save(create(_TFX), tmp_path / "out", architecture=architecture)
    assert not (tmp_path / "out").exists()


def test_missing_expert_is_named():
    config = mixtral.config_from_hf(dict(BASE, num_hidden_layers=1), MIXTRAL)
    tensors = mixtral.params_to_hf(io.flat_params(create(config)), config)
    del tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(ValueError, match=r"experts\.3\.w2\.weight.*missing"):
        mixtral.params_from_hf(tensors, config)
