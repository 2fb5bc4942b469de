"""Phi3ForCausalLM, Olmo2ForCausalLM and GPTNeoXForCausalLM checkpoints: tfx.hf.load / save
against transformers (eager attention, float32).

Tiny random models (width 32, 4 heads of 8, two layers, weights perturbed so that norms and
biases matter), each case adding features:

- phi3: fused qkv_proj (grouped-query: 4 query and 2 key/value heads) and gate_up_proj, a
  sliding window of 4 on every layer (narrower than the sequences; the decode goes past it),
  partial rotary factor 0.5, tied head.
- olmo2: norms on the branch outputs only, q/k RMS norms across heads (q_norm [32], k_norm
  [16]: grouped-query), attention_bias (q, k, v and o, no MLP bias).
- neox-parallel: Pythia's layout (parallel residual, biases everywhere, LayerNorm, exact GELU,
  per-head interleaved query_key_value, rotary on the first half of each head's features).
- neox-sequential: the sequential residual, attention_bias false (MLP biases only), a linear-
  scaled RoPE on a quarter of each head's features, tied head.

Each: logits on a right-padded batch at the real positions; `tfx.hf.save` read back by
transformers (same logits, same config back). The first three: greedy `tfx.generate` token for
token as HF's generate on left-padded prompts of different lengths (phi3's decode goes past its
window: tfx's ring-buffer cache against HF's sliding-window cache).
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

import tfx.hf  # noqa: E402
from tfx.hf import gpt_neox, io, olmo2, phi3  # noqa: E402
from tfx.models import DecoderConfig  # noqa: E402
from tfx.ops.positional import LinearScaling  # noqa: E402

PHI3, OLMO2, NEOX = "Phi3ForCausalLM", "Olmo2ForCausalLM", "GPTNeoXForCausalLM"
SEQ, NEW = 12, 10
SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64)
LLAMA_LIKE = dict(SIZES, num_key_value_heads=2, rms_norm_eps=1e-6, pad_token_id=0,
                  eos_token_id=None)
CASES = {
    "phi3": (PHI3, dict(LLAMA_LIKE, sliding_window=4, partial_rotary_factor=0.5,
                        tie_word_embeddings=True)),
    "olmo2": (OLMO2, dict(LLAMA_LIKE, attention_bias=True)),
    "neox-parallel": (NEOX, dict(SIZES, rotary_pct=0.5, layer_norm_eps=1e-6)),
    "neox-sequential": (NEOX, dict(
        SIZES, use_parallel_residual=False, attention_bias=False, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=100.0,
                             partial_rotary_factor=0.25))),
}
# Seeds whose greedy continuations visit several tokens (tiny random models often repeat one).
_SEEDS = {"olmo2": 2, "neox-sequential": 1}


def _hf_model(case: str):
    architecture, fields = CASES[case]
    return hf_causal_lm(torch, transformers, architecture, fields, seed=_SEEDS.get(case, 0),
                        scale=0.3)


loaded, test_logits_match_transformers = parity_tests(torch, CASES, _hf_model, SEQ)


def test_config_mapping(loaded):
    case, _, model = loaded
    c = model.config
    expected = {
        "phi3": dict(kv_heads=2, window=4, fraction=0.5, norm=("rms", True, False),
                     qk_norm=None, parallel=False, biases=(False, False, False), tie=True),
        "olmo2": dict(kv_heads=2, window=None, fraction=1.0, norm=("rms", False, True),
                      qk_norm="across_heads", parallel=False, biases=(True, True, False),
                      tie=False),
        "neox-parallel": dict(kv_heads=4, window=None, fraction=0.5, norm=("layer", True, False),
                              qk_norm=None, parallel=True, biases=(True, True, True), tie=False),
        "neox-sequential": dict(kv_heads=4, window=None, fraction=0.25,
                                norm=("layer", True, False), qk_norm=None, parallel=False,
                                biases=(False, False, True), tie=True),
    }[case]
    assert c.kv_heads == expected["kv_heads"]
    assert c.attention.sliding_window == expected["window"]
    assert c.rope.fraction == expected["fraction"]
    assert (c.norm.kind, c.norm.inputs, c.norm.outputs) == expected["norm"]
    assert c.attention.qk_norm == expected["qk_norm"] and c.mlp.parallel == expected["parallel"]
    has = tfx.hf.llama.biases(c)
    assert (has["query"], has["out"], has["mlp"]) == expected["biases"]
    assert c.embeddings.tie == expected["tie"]
    assert c.mlp.gated == (case in ("phi3", "olmo2"))
    assert c.rope.scaling == (LinearScaling(2.0) if case == "neox-sequential" else None)


@pytest.mark.parametrize("loaded", ["phi3", "olmo2", "neox-parallel"], indirect=True)
def test_greedy_generation_matches_transformers(loaded):
    _, hf_model, model = loaded
    assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)


def test_save_round_trips_through_transformers(loaded, tmp_path):
    case, _, model = loaded
    save_round_trips(torch, transformers, model, tmp_path, CASES[case][0], SEQ)


@pytest.mark.parametrize("loaded", ["neox-parallel"], indirect=True)
def test_neox_in_memory_names_load_like_saved_ones(loaded, tmp_path):
    """transformers 5's own parameter names (the head at lm_head, not embed_out) give the same
    model as the save_pretrained files."""
    _, hf_model, model = loaded
    assert "embed_out.weight" not in hf_model.state_dict()
    assert_in_memory_layout_loads(hf_model, model, tmp_path, NEOX, "lm_head.weight")


def test_neox_older_config_fields():
    """Pythia's config.json says rotary_pct, rotary_emb_base and no rope_parameters; GPT-NeoX
    reads them (a top-level rope_theta it ignores), and tanh GELU under either name."""
    fields = dict(SIZES, rotary_pct=0.25, rotary_emb_base=500.0, rope_theta=7.0,
                  hidden_act="gelu_pytorch_tanh")
    config = gpt_neox.config_from_hf(fields, NEOX)
    assert (config.rope.fraction, config.rope.theta) == (0.25, 500.0)
    assert config.mlp.activation == "gelu_tanh"
    hf = transformers.GPTNeoXConfig(**fields)
    assert hf.rope_parameters["partial_rotary_factor"] == 0.25
    assert hf.rope_parameters["rope_theta"] == 500.0
    assert gpt_neox.config_to_hf(config, NEOX)["hidden_act"] == "gelu_new"


@pytest.mark.parametrize("module, architecture, fields, match", [
    (phi3, PHI3, dict(rope_parameters=dict(rope_type="longrope", short_factor=[1.0],
                                           long_factor=[1.0])), "rope_type='longrope'.*LongRoPE"),
    (phi3, PHI3, dict(rope_scaling=dict(type="su", short_factor=[1.0], long_factor=[1.0])),
     "rope_type='su'.*LongRoPE"),
    (phi3, PHI3, dict(rope_parameters=dict(rope_type="linear", factor=2.0)), "rope_type"),
    (phi3, PHI3, dict(hidden_act="gelu"), "hidden_act"),
    (olmo2, OLMO2, dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (olmo2, OLMO2, dict(hidden_act="relu"), "hidden_act"),
    (gpt_neox, NEOX, dict(hidden_act="gelu_fast"), "hidden_act"),
    (gpt_neox, NEOX, dict(rope_parameters=dict(rope_type="longrope")), "rope_type"),
])
def test_unsupported_hf_settings_raise(module, architecture, fields, match):
    with pytest.raises(ValueError, match=match):
        module.config_from_hf(dict(LLAMA_LIKE, **fields), architecture)


_LLAMA_LIKE = DecoderConfig(vocab_size=99, d_model=32, num_layers=1, num_heads=4, d_ff=48,
                            position="rope", norm={"kind": "rms"},
                            mlp={"activation": "silu", "gated": True}, use_bias=False)
_OLMO2 = _LLAMA_LIKE.replace(norm={"inputs": False, "outputs": True},
                             attention={"qk_norm": "across_heads"})
_NEOX = DecoderConfig(vocab_size=99, d_model=32, num_layers=1, num_heads=4, d_ff=48,
                      position="rope", mlp={"parallel": True})


@pytest.mark.parametrize("module, architecture, config, match", [
    (phi3, PHI3, _LLAMA_LIKE.replace(use_bias=True), "use_bias"),
    (phi3, PHI3, _LLAMA_LIKE.replace(attention={"qkv_bias": True}), "qkv_bias"),
    (phi3, PHI3, _LLAMA_LIKE.replace(rope={"scaling": LinearScaling(2.0)}), r"rope\.scaling"),
    (phi3, PHI3, _OLMO2, r"norm\.inputs"),
    (olmo2, OLMO2, _LLAMA_LIKE, r"norm\.inputs"),
    (olmo2, OLMO2, _OLMO2.replace(attention={"sliding_window": 4}), "sliding_window"),
    (olmo2, OLMO2, _OLMO2.replace(attention={"qkv_bias": True}), "out_bias"),
    (olmo2, OLMO2, _OLMO2.replace(rope={"fraction": 0.5}), r"rope\.fraction"),
    (gpt_neox, NEOX, _LLAMA_LIKE, r"norm\.kind"),
    (gpt_neox, NEOX, _NEOX.replace(attention={"num_kv_heads": 2}), "num_kv_heads"),
    (gpt_neox, NEOX, _NEOX.replace(attention={"out_bias": False}), "out_bias"),
    (gpt_neox, NEOX, _NEOX.replace(norm={"outputs": True}), r"norm\.outputs"),
])
def test_configs_transformers_cannot_express_raise(module, architecture, config, match):
    with pytest.raises(ValueError, match=match):
        module.config_to_hf(config, architecture)


def test_packed_tensor_of_the_wrong_shape_is_named():
    config = phi3.config_from_hf(dict(LLAMA_LIKE, num_hidden_layers=1), PHI3)
    tensors = phi3.params_to_hf(io.flat_params(tfx.models.create(config)), config)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-8]
    with pytest.raises(ValueError, match=r"qkv_proj\.weight.*\[64, d\]"):
        phi3.params_from_hf(tensors, config)
