"""GptOssForCausalLM checkpoints: tfx.hf.load / save against transformers (eager attention,
float32).

Tiny random models (width 32, 4 query and 2 key/value heads of 8, 4 experts of width 24, two
layers, every weight perturbed so that sinks, norms and biases matter), each case adding
features:

- yarn: a sliding then a full layer (window 4, narrower than the sequences; the decode goes
  past it), YaRN rope without truncation, attention_bias, top-2 of 4 experts, untied head.
- clamped: a full then a sliding layer, YaRN with truncation, no attention bias, top-1 (its
  weight is 1), tied head, and a swiglu_limit of 0.5 with gain 1.2, which the tiny experts'
  gate and up values exceed: the clamps matter.

Each: logits on a right-padded batch at the real positions; `tfx.hf.save` read back by
transformers (same logits, same config back); greedy `tfx.generate` token for token as HF's
generate on left-padded prompts of different lengths (no EOS on either side).
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from causal_lm_parity import (  # noqa: E402
    PROMPTS,
    assert_greedy_matches,
    hf_causal_lm,
    padded_inputs,
    parity_tests,
    save_round_trips,
    tfx_logits,
)
from flax import nnx  # noqa: E402

import tfx.hf  # noqa: E402
import tfx.peft  # noqa: E402
from tfx.hf import gpt_oss, io  # noqa: E402
from tfx.models import create, families  # noqa: E402
from tfx.ops.positional import YaRNScaling  # noqa: E402

GPT_OSS = "GptOssForCausalLM"
SEQ, NEW = 12, 10
BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
            rms_norm_eps=1e-6, sliding_window=4, pad_token_id=0, eos_token_id=None)
YARN = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=8.0, beta_slow=1.0)
CASES = {
    "yarn": dict(rope_parameters=dict(YARN, truncate=False)),
    "clamped": dict(rope_parameters=dict(YARN, truncate=True), attention_bias=False,
                    layer_types=["full_attention", "sliding_attention"], num_experts_per_tok=1,
                    tie_word_embeddings=True, swiglu_limit=0.5, swiglu_alpha=1.2),
}
# Seeds whose greedy continuations visit several tokens (tiny random models often repeat one).
_SEEDS = {"clamped": 3}


def _hf_model(case: str):
    return hf_causal_lm(torch, transformers, GPT_OSS, {**BASE, **CASES[case]},
                        seed=_SEEDS.get(case, 0), scale=0.3)


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    c = model.config
    clamped = case == "clamped"
    assert c.attention.sinks and c.attention.sliding_window == 4 and c.kv_heads == 2
    assert c.attention.layer_types == (("full", "sliding") if clamped else ("sliding", "full"))
    assert c.attention.qkv_bias == c.attention.out_bias == (not clamped)
    assert c.rope.scaling == YaRNScaling(4.0, 16, beta_fast=8.0, beta_slow=1.0,
                                         truncate=clamped)
    assert (c.moe.num_experts, c.moe.experts_per_token, c.moe.d_ff) == (4, 1 if clamped else 2,
                                                                       24)
    assert (c.moe.policy, c.moe.renormalize, c.moe.router_bias, c.moe.expert_bias) == (
        "topk", True, True, True)
    assert (c.moe.swiglu_limit, c.moe.swiglu_alpha) == ((0.5, 1.2) if clamped else (7.0, 1.702))
    assert c.embeddings.tie == clamped
    assert families.GPT_OSS.mismatches(c) == {}


def test_greedy_generation_matches_transformers(loaded):
    _, hf_model, model = loaded
    assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)


def test_save_round_trips_through_transformers(loaded, tmp_path):
    _, _, model = loaded
    reloaded = save_round_trips(torch, transformers, model, tmp_path, GPT_OSS, SEQ)
    # The loss weight is a training setting, not the model's: a save writes the default.
    assert reloaded.config.router_aux_loss_coef == pytest.approx(0.001)


@pytest.mark.parametrize("loaded", ["yarn"], indirect=True)
def test_lora_on_the_biased_projections(loaded):
    """LoRA wraps the query and value projections (biases kept): zero at init, then trained."""
    _, _, model = loaded
    adapted = nnx.clone(model)  # the fixture's model stays as loaded
    ids, mask = padded_inputs(SEQ)
    tfx.peft.LoRA(rank=2, alpha=4.0).attach(adapted, rngs=nnx.Rngs(1))
    np.testing.assert_allclose(tfx_logits(adapted, ids, mask), tfx_logits(model, ids, mask),
                               rtol=1e-5, atol=1e-5)
    attention = adapted.stack.layers[0].attention
    assert attention.query.bias is not None
    nnx.update(adapted, jax.tree.map(lambda x: x + 0.5, nnx.state(adapted, tfx.peft.PeftParam)))
    assert not np.allclose(tfx_logits(adapted, ids, mask), tfx_logits(model, ids, mask))


# gpt-oss-20b's config.json as the hub has it (transformers 4.55 wrote it).
PUBLIC_20B = dict(
    architectures=[GPT_OSS], attention_bias=True, attention_dropout=0.0, eos_token_id=200002,
    experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880,
    initial_context_length=4096, intermediate_size=2880,
    layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
    model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24,
    num_key_value_heads=8, num_local_experts=32, output_router_logits=False,
    pad_token_id=199999, rms_norm_eps=1e-5,
    rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0,
                      original_max_position_embeddings=4096, rope_type="yarn", truncate=False),
    rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0,
    tie_word_embeddings=False, vocab_size=201088)


def test_the_public_config_reads_as_gpt_oss_20b_with_its_yarn():
    """The named size with the YaRN scaling its card cannot hold (jax-free cards)."""
    config = gpt_oss.config_from_hf(PUBLIC_20B, GPT_OSS)
    yarn = YaRNScaling(32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False)
    expected = families.size_config("gpt-oss-20b").replace(rope={"scaling": yarn})
    assert families.canonical(config) == families.canonical(expected)
    assert gpt_oss.train_settings(PUBLIC_20B)["load_balancing_weight"] == 0.0


@pytest.mark.parametrize("fields, match", [
    (dict(quantization_config=dict(quant_method="mxfp4")), "quantization_config.*'mxfp4'"),
    (dict(sliding_window=None), "sliding_window=None"),
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(rope_parameters=dict(rope_type="longrope")), "rope_type='longrope'"),
    (dict(rope_parameters=dict(YARN, partial_rotary_factor=0.5)), "partial_rotary_factor"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
])
def test_unsupported_hf_settings_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        gpt_oss.config_from_hf({**BASE, **fields}, GPT_OSS)


_CONFIG = gpt_oss.config_from_hf(BASE, GPT_OSS)


@pytest.mark.parametrize("changes, match", [
    (dict(attention={"sinks": False}), r"attention\.sinks=False"),
    (dict(moe={"router_bias": False}), r"moe\.router_bias=False"),
    (dict(moe={"expert_bias": False}), r"moe\.expert_bias=False"),
    (dict(moe={"renormalize": False}), r"moe\.renormalize=False"),
    (dict(moe={"capacity_factor": 1.0}), r"moe\.capacity_factor=1\.0"),
    (dict(moe={"swiglu_limit": None}), r"moe\.swiglu_limit"),
    (dict(moe=None), r"moe=None"),
    (dict(attention={"sliding_window": None, "layer_types": None}), "sliding_window"),
    (dict(attention={"out_bias": False}), "out_bias"),
])
def test_configs_gpt_oss_cannot_express_raise(changes, match):
    with pytest.raises(ValueError, match=match):
        gpt_oss.config_to_hf(_CONFIG.replace(**changes), GPT_OSS)


def test_gate_up_columns_interleave():
    """gate_up_proj's even columns are the gate, its odd ones the up projection."""
    config = _CONFIG.replace(num_layers=1, attention={"layer_types": ("full",)})
    params = io.flat_params(create(config, rngs=nnx.Rngs(0)))
    tensors = gpt_oss.params_to_hf(params, config)
    experts = ("stack", "layers", 0, "mlp", "experts")
    fused = tensors["model.layers.0.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(fused[..., 0::2], params[(*experts, "gate")])
    np.testing.assert_array_equal(fused[..., 1::2], params[(*experts, "up")])
    back = gpt_oss.params_from_hf(tensors, config)
    assert back.keys() == params.keys()
    for path in params:
        np.testing.assert_array_equal(back[path], params[path], err_msg=str(path))
    assert tensors["model.layers.0.self_attn.sinks"].shape == (4,)
