"""Export of LoRA factors in peft's adapter format: the base model saved with `tfx.hf.save` (or
the transformers folder the tfx model was loaded from), the adapter with `save_peft_adapter`;
transformers + `peft.PeftModel.from_pretrained` must then compute what the tfx LoRA model
computes, and the files must be what peft's own `save_pretrained` writes for the same
LoraConfig (names, shapes, config).

Every family peft knows is a tiny perturbed transformers model (tests/causal_lm_parity.py),
loaded by `tfx.hf.load` from its save_pretrained folder, with random non-zero factors on every
target it has. The fused modules (Phi-3's qkv_proj and gate_up_proj, GPT-NeoX's
query_key_value, GPT-2's Conv1D c_attn) get one LoRA of rank k·r (rank_pattern); the NeoX case
adapts only query and value of its query_key_value (a zero key block)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from causal_lm_parity import hf_causal_lm  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import tfx.hf  # noqa: E402
from tfx.hf import bert, llama, qwen  # noqa: E402
from tfx.hf.peft_adapter import save_peft_adapter  # noqa: E402
from tfx.models import create  # noqa: E402
from tfx.peft import LoRA  # noqa: E402
from tfx.peft.core import PeftParam  # noqa: E402

LLAMA = "LlamaForCausalLM"
VOCAB, SEQ = 99, 10
# GQA: 4 query heads share 2 key/value heads, so k/v projections are narrower than q.
TINY_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
PROJECTIONS = ("query", "key", "value", "out", "up", "down")
ALL = (*PROJECTIONS, "gate")
# Each family: (architecture, config fields beyond TINY_LLAMA's, LoRA targets, config class or
# None for the architecture's own). Some cases adapt an untied head or token embeddings too.
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=16)
GEMMA = dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=24, tie_word_embeddings=False)
FAMILIES = {
    "mistral": ("MistralForCausalLM", dict(sliding_window=4), (*ALL, "tokens", "head"), None),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2),
                ("query", "key", "value", "out", "head"), None),
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False), (*ALL, "tokens"), None),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True), ALL, None),
    # MLPs are refused (peft reads gate_proj, ... as the experts): attention only.
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(EXPERTS, num_experts=4, mlp_only_layers=[0]),
                  ("query", "key", "value", "out"), None),
    "gemma2": ("Gemma2ForCausalLM", dict(GEMMA, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=3.0), (*ALL, "tokens"), None),
    "gemma3": ("Gemma3ForCausalLM", GEMMA, (*ALL, "head"), "Gemma3TextConfig"),
    "phi3": ("Phi3ForCausalLM", dict(pad_token_id=0), (*ALL, "tokens"), None),
    "olmo2": ("Olmo2ForCausalLM", dict(attention_bias=True, pad_token_id=0), ALL, None),
    "gpt-neox": ("GPTNeoXForCausalLM", dict(num_key_value_heads=None, rotary_pct=0.5),
                 ("query", "value", "out", "down", "tokens", "head"), None),
    # GPT2Config reads TINY_LLAMA's sizes by their other names (its attribute_map).
    "gpt2": ("GPT2LMHeadModel", {}, PROJECTIONS, None),
    "deepseek-v3": ("DeepseekV3ForCausalLM", dict(
        EXPERTS, num_key_value_heads=4, n_routed_experts=4, n_group=1, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
        ("q_a", "q_b", "kv_a", "kv_b", "out", "head"), None),
}
# The fused modules' ranks (rank_pattern) for rank 2.
FUSED_RANKS = {"phi3": {"qkv_proj": 6, "gate_up_proj": 4}, "gpt-neox": {"query_key_value": 4},
               "gpt2": {"c_attn": 6}}


def _llama(**overrides):
    return llama.config_from_hf({**TINY_LLAMA, **overrides}, LLAMA)


def _randomize(model, seed: int = 0):
    """Every LoRA factor random: init leaves b = 0, which would hide a wrongly laid out b."""
    # numpy draws: eager jax.random would compile once per factor shape.
    rng = np.random.default_rng(seed)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype),
                                   nnx.state(model, PeftParam)))
    return model


def _with_lora(config, lora: LoRA, seed: int = 0):
    model = create(config, rngs=nnx.Rngs(seed))
    lora.attach(model, rngs=nnx.Rngs(seed + 1))
    return _randomize(model, seed)


def _export(model, tmp_path, architecture, base_model=None):
    """Save the plain weights (LoRA's wrapped layers keep their paths) and the adapter."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    tfx.hf.save(model, base, architecture=architecture)
    save_peft_adapter(model, adapter, architecture=architecture, base_model=base_model)
    return base, adapter


def _ids(batch=2, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, SEQ))


def _assert_peft_matches(model, base, adapter, ids, output="logits"):
    """transformers' model in `base` with the peft adapter computes `model`'s output, and the
    adapter matters (a silently dropped factor would not change it)."""
    auto = transformers.AutoModelForCausalLM if output == "logits" else transformers.AutoModel
    hf = auto.from_pretrained(base, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    with torch.no_grad():
        theirs = getattr(peft_model(input_ids=torch.tensor(ids)), output).numpy()
        with peft_model.disable_adapter():
            plain = getattr(peft_model(input_ids=torch.tensor(ids)), output).numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), theirs, atol=1e-4, rtol=1e-4)
    assert np.abs(plain - theirs).max() > 1e-2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family(tmp_path, family):
    architecture, fields, targets, config_class = FAMILIES[family]
    hf = hf_causal_lm(torch, transformers, architecture, {**TINY_LLAMA, **fields}, scale=0.3,
                      config_class=config_class and getattr(transformers, config_class))
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    hf.save_pretrained(base)
    model = _randomize(LoRA(rank=2, alpha=3.0, targets=targets).attach(
        tfx.hf.load(base), rngs=nnx.Rngs(1)))
    save_peft_adapter(model, adapter, architecture=architecture, base_model=str(base))
    _assert_peft_matches(model, base, adapter, _ids())
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["rank_pattern"] == FUSED_RANKS.get(family, {})
    assert config["alpha_pattern"] == {name: 1.5 * r for name, r in config["rank_pattern"].items()}
    assert config["fan_in_fan_out"] == (family == "gpt2")


@pytest.mark.parametrize("scan_layers, lora", [
    (False, LoRA(rank=4, alpha=8.0, targets=(*ALL, "tokens", "head"))),
    pytest.param(True, LoRA(rank=3, alpha=5.0, targets=PROJECTIONS, rslora=True),
                 marks=pytest.mark.slow),  # stacked layers compile their own scan: ~10 s
], ids=["all-targets", "scan-rslora"])
def test_peft_model_matches_tfx_lora(tmp_path, scan_layers, lora):
    model = _with_lora(_llama().replace(compute={"scan_layers": scan_layers}), lora)
    base, adapter = _export(model, tmp_path, LLAMA)
    _assert_peft_matches(model, base, adapter, _ids())


def test_files_are_what_peft_writes(tmp_path):
    """peft itself, given our config, writes the same tensor names and shapes, and the same
    values for the fields we set."""
    model = _with_lora(_llama(), LoRA(rank=4, alpha=8.0, targets=("query", "value", "tokens")))
    base, adapter = _export(model, tmp_path, LLAMA, base_model="org/tiny-llama")
    config = peft.PeftConfig.from_pretrained(adapter)
    assert (config.peft_type, config.task_type) == ("LORA", "CAUSAL_LM")
    assert (config.r, config.lora_alpha, config.use_rslora) == (4, 8, False)
    assert set(config.target_modules) == {"q_proj", "v_proj", "embed_tokens"}
    assert config.base_model_name_or_path == "org/tiny-llama"
    assert (config.bias, config.fan_in_fan_out) == ("none", False)

    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    reference = tmp_path / "reference"
    peft.get_peft_model(hf, config).save_pretrained(reference)
    ours, theirs = (load_file(str(d / "adapter_model.safetensors")) for d in (adapter, reference))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert ours["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (16, 4)
    assert ours["base_model.model.model.embed_tokens.lora_embedding_A"].shape == (4, VOCAB)
    written, expected = (json.loads((d / "adapter_config.json").read_text())
                         for d in (adapter, reference))
    # peft writes target_modules from a set, and base_model_name_or_path as the folder it used.
    for config in (written, expected):
        config["target_modules"] = sorted(config["target_modules"])
        config.pop("base_model_name_or_path")
    assert {k: expected[k] for k in written} == written


def test_some_layers_are_named_in_full(tmp_path):
    """A target on layer 0 only must not become "q_proj" (which peft applies to every layer)."""
    model = _with_lora(_llama(), LoRA(rank=2, targets=r"stack/layers/0/attention/query"))
    _, adapter = _export(model, tmp_path, LLAMA)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.0.self_attn.q_proj"]


@pytest.mark.slow  # a second model family to build: ~6 s
def test_bert_model(tmp_path):
    config = bert.config_from_hf(dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=48), "BertModel")
    model = _with_lora(config, LoRA(rank=2, targets=("query", "value", "out", "up", "down")))
    model.eval()
    base, adapter = _export(model, tmp_path, "BertModel")
    _assert_peft_matches(model, base, adapter, _ids(), output="last_hidden_state")


def test_errors(tmp_path):
    plain = create(_llama(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no LoRA factors"):
        save_peft_adapter(plain, tmp_path, architecture=LLAMA)
    adapted = _with_lora(_llama(), LoRA(rank=2))
    with pytest.raises(ValueError, match=r"architecture must be one of .*LlamaForCausalLM"):
        save_peft_adapter(adapted, tmp_path, architecture="T5ForConditionalGeneration")
    with pytest.raises(ValueError, match="GPT2LMHeadModel cannot express"):
        save_peft_adapter(adapted, tmp_path, architecture="GPT2LMHeadModel")
    tied = _with_lora(_llama(tie_word_embeddings=True), LoRA(rank=2, targets=("tokens",)))
    with pytest.raises(ValueError, match="tied token embeddings"):
        save_peft_adapter(tied, tmp_path, architecture=LLAMA)
    moe = _llama().replace(moe={"num_experts": 4})
    routed = _with_lora(moe, LoRA(rank=2, targets=("query", "router")))
    with pytest.raises(ValueError, match="mlp/router have no MixtralForCausalLM module"):
        save_peft_adapter(routed, tmp_path, architecture="MixtralForCausalLM")
    with pytest.raises(ValueError, match="cannot express a model with experts"):
        save_peft_adapter(routed, tmp_path, architecture=LLAMA)
    qwen_moe = qwen.config_from_hf(dict(TINY_LLAMA, **EXPERTS, num_experts=4, mlp_only_layers=[0]),
                                   "Qwen3MoeForCausalLM")
    dense_mlp = _with_lora(qwen_moe, LoRA(rank=2, targets=("query", "up")))
    with pytest.raises(ValueError, match=r"layers/0/mlp/up .* peft reads a target named up_proj"):
        save_peft_adapter(dense_mlp, tmp_path, architecture="Qwen3MoeForCausalLM")
    with pytest.raises(TypeError, match="base_model"):
        save_peft_adapter(adapted, tmp_path, architecture=LLAMA, base_model=3)
    assert not list(tmp_path.iterdir())  # nothing written by a failed export
