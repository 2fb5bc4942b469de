"""DeepseekV3ForCausalLM checkpoints: tfx.hf.load / save against transformers (eager attention,
float32).

Tiny random models (hidden 32, 4 heads, 8 routed experts of width 16, top-3), weights and the
routers' e_score_correction_bias buffers perturbed so that every part matters:

- "lora-groups": three layers, the first dense (first_k_dense_replace=1); low-rank queries
  (q_lora_rank), interleaved RoPE; group-limited routing over 4 groups of 2 experts, 2 per
  token; 2 shared experts; renormalised weights times 2.5; untied head.
- "plain-yarn": two layers, both with experts; a plain query projection (q_lora_rank null),
  the "half" rotary layout, YaRN (factor 4, mscale 1 and mscale_all_dim 0.8: both the
  rotary attention factor and the mscale² of the softmax scale differ from 1); no groups;
  weights not renormalised, times 1.5; one shared expert; head tied to the embeddings.

Logits on a right-padded batch at the real positions; greedy `tfx.generate` through the latent
cache token for token as HF's generate on left-padded prompts; `tfx.hf.save` read back by
transformers (same tensors, logits and config); transformers' fused in-memory expert layout.
"""

import numpy as np
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

from tfx.hf import deepseek, io  # noqa: E402
from tfx.ops.kv_cache import LatentKV  # noqa: E402

DEEPSEEK = "DeepseekV3ForCausalLM"
SEQ, NEW = 12, 12
BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=3, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=6, max_position_embeddings=64, rms_norm_eps=1e-6)
CASES = {
    "lora-groups": dict(num_hidden_layers=3, q_lora_rank=24, rope_interleave=True,
                        first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=2,
                        norm_topk_prob=True, routed_scaling_factor=2.5,
                        rope_parameters=dict(rope_type="default", rope_theta=100.0)),
    "plain-yarn": dict(num_hidden_layers=2, q_lora_rank=None, rope_interleave=False,
                       first_k_dense_replace=0, n_group=1, topk_group=1, n_shared_experts=1,
                       norm_topk_prob=False, routed_scaling_factor=1.5, tie_word_embeddings=True,
                       rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=4.0,
                                            original_max_position_embeddings=16, mscale=1.0,
                                            mscale_all_dim=0.8)),
}


def _hf_model(case: str):
    model = hf_causal_lm(torch, transformers, DEEPSEEK, {**BASE, **CASES[case]}, scale=0.3)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: perturb() leaves it 0
                buffer.copy_(0.1 * torch.randn_like(buffer))
        if model.config.tie_word_embeddings:  # a large tied table makes the head repeat the input
            model.model.embed_tokens.weight.mul_(0.1)
    return model


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, hf_model, model = loaded
    c, hf = model.config, CASES[case]
    assert (c.latent.q_lora_rank, c.latent.kv_lora_rank, c.latent.v_head_dim) == (
        hf["q_lora_rank"], 16, 6)
    assert c.attention.num_kv_heads is None and c.rope.theta == 100.0
    assert c.rope.layout == ("interleaved" if hf["rope_interleave"] else "half")
    assert (c.moe.policy, c.moe.num_experts, c.moe.experts_per_token, c.moe.d_ff, c.d_ff) == (
        "deepseek", 8, 3, 16, 48)
    assert (c.moe.first_dense, c.moe.num_groups, c.moe.groups_per_token) == (
        hf["first_k_dense_replace"], hf["n_group"], hf["topk_group"])
    assert (c.moe.shared_experts, c.moe.renormalize, c.moe.routed_scale) == (
        hf["n_shared_experts"], hf["norm_topk_prob"], hf["routed_scaling_factor"])
    assert c.embeddings.tie == hf.get("tie_word_embeddings", False)
    # The softmax scale is transformers' own (mscale² under YaRN with mscale_all_dim).
    assert (c.attention.scale or 12**-0.5) == pytest.approx(
        hf_model.model.layers[0].self_attn.scaling, rel=1e-12)
    if case == "plain-yarn":
        assert c.rope.scaling.mscale_all_dim == 0.8 and c.attention.scale != 12**-0.5
    last = hf_model.config.num_hidden_layers - 1
    np.testing.assert_array_equal(
        io.flat_params(model)[("stack", "layers", last, "mlp", "selection_bias")],
        hf_model.model.layers[last].mlp.gate.e_score_correction_bias.numpy())


@pytest.mark.parametrize("loaded", ["plain-yarn"], indirect=True)  # the cheaper to compile
def test_greedy_generation_matches_transformers(loaded):
    _, hf_model, model = loaded
    # tfx decodes through the latent cache: latent + rotary key, 16 + 4 floats a layer.
    cache = model.init_cache(1, 8)
    assert all(isinstance(layer, LatentKV) for layer in cache.layers)
    assert cache.bytes_per_token == 2 * (16 + 4) * 4
    assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)


def test_save_round_trips_through_transformers(loaded, tmp_path):
    _, hf_model, model = loaded
    reloaded = save_round_trips(torch, transformers, model, tmp_path, DEEPSEEK, SEQ)
    assert reloaded.config.num_nextn_predict_layers == 0  # tfx writes no MTP layers
    original, saved = hf_model.state_dict(), reloaded.state_dict()
    assert saved.keys() == original.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("loaded", ["lora-groups"], indirect=True)
def test_fused_layout_loads_like_per_expert(loaded, tmp_path):
    """transformers 5's in-memory names (experts fused [E, 2f, d], gate rows first) give the
    same model as the per-expert files."""
    _, hf_model, model = loaded
    assert_in_memory_layout_loads(hf_model, model, tmp_path, DEEPSEEK,
                                  "model.layers.1.mlp.experts.gate_up_proj")


def _tiny(**fields):
    return deepseek.config_from_hf({**BASE, **CASES["lora-groups"], **fields}, DEEPSEEK)


@pytest.mark.parametrize("loaded", ["lora-groups"], indirect=True)
def test_mtp_tensors_are_ignored_where_transformers_ignores_them(loaded):
    """transformers ignores `model.layers.61.*` (the MTP layer of the 61-layer checkpoints);
    an MTP layer at any other index is unexpected to both."""
    _, _, model = loaded
    config = model.config
    tensors = deepseek.params_to_hf(io.flat_params(model), config)
    mtp = np.zeros((4, 64), np.float32)
    assert deepseek.params_from_hf({**tensors, "model.layers.61.eh_proj.weight": mtp}, config)
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.3\.eh_proj"):
        deepseek.params_from_hf({**tensors, "model.layers.3.eh_proj.weight": mtp}, config)


def test_config_defaults_are_deepseek_v3s():
    minimal = dict(vocab_size=99, hidden_size=32, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=8)
    config = deepseek.config_from_hf(minimal, DEEPSEEK)
    reference = transformers.DeepseekV3Config(**minimal)
    assert config.rope.theta == reference.rope_parameters["rope_theta"]
    assert config.rope.layout == "interleaved" and reference.rope_interleave
    assert config.d_ff == reference.intermediate_size
    assert config.moe.d_ff == reference.moe_intermediate_size
    assert (config.moe.num_experts, config.moe.experts_per_token) == (
        reference.n_routed_experts, reference.num_experts_per_tok)
    assert (config.moe.num_groups, config.moe.groups_per_token, config.moe.first_dense) == (
        reference.n_group, reference.topk_group, reference.first_k_dense_replace)
    assert (config.moe.shared_experts, config.moe.routed_scale, config.moe.renormalize) == (
        reference.n_shared_experts, reference.routed_scaling_factor, reference.norm_topk_prob)
    assert (config.latent.q_lora_rank, config.latent.kv_lora_rank, config.latent.v_head_dim) == (
        reference.q_lora_rank, reference.kv_lora_rank, reference.v_head_dim)
    assert config.embeddings.tie == reference.tie_word_embeddings
    assert config.norm.eps == reference.rms_norm_eps


@pytest.mark.parametrize("fields, match", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
    (dict(n_shared_experts=0), "n_shared_experts"),
    (dict(n_group=None), "n_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="linear", factor=2.0, mscale_all_dim=1.0)),
     "mscale_all_dim"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "rope_type"),
])
def test_unsupported_hf_settings_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        _tiny(**fields)


@pytest.mark.parametrize("changes, match", [
    (dict(latent=None, attention={"num_kv_heads": 4}), "latent"),
    (dict(moe=None), "moe"),
    (dict(moe={"policy": "topk", "num_groups": 1, "groups_per_token": 1}), r"moe\.policy"),
    (dict(moe={"capacity_factor": 1.25}), r"moe\.capacity_factor"),
    (dict(moe={"shared_experts": 0}), r"moe\.shared_experts"),
    (dict(use_bias=True), "use_bias"),
    (dict(norm={"eps": 1e-5}), r"norm\.eps"),
    (dict(attention={"scale": 0.5}), r"attention\.scale"),
])
def test_configs_deepseek_cannot_express_raise(changes, match):
    with pytest.raises(ValueError, match=match):
        deepseek.config_to_hf(_tiny().replace(**changes), DEEPSEEK)
