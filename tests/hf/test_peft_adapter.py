"""Export of LoRA factors in peft's adapter format: the base model saved with `tfx.hf.save`, the
adapter with `save_peft_adapter`; transformers + `peft.PeftModel.from_pretrained` must then
compute what the tfx LoRA model computes, and the files must be what peft's own
`save_pretrained` writes for the same LoraConfig (names, shapes, config)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.numpy import load_file  # noqa: E402

import tfx.hf  # noqa: E402
from tfx.hf import bert, llama  # noqa: E402
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


def _llama(**overrides):
    return llama.config_from_hf({**TINY_LLAMA, **overrides}, LLAMA)


def _with_lora(config, lora: LoRA, seed: int = 0):
    """A tfx model with `lora` attached and every factor random: init leaves b = 0, which
    would hide a wrongly laid out b."""
    model = create(config, rngs=nnx.Rngs(seed))
    lora.attach(model, rngs=nnx.Rngs(seed + 1))
    # numpy draws: eager jax.random would compile once per factor shape.
    rng = np.random.default_rng(seed)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype),
                                   nnx.state(model, PeftParam)))
    return model


def _export(model, tmp_path, architecture, base_model=None):
    """Save the plain weights (LoRA's wrapped layers keep their paths) and the adapter."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    tfx.hf.save(model, base, architecture=architecture)
    save_peft_adapter(model, adapter, architecture=architecture, base_model=base_model)
    return base, adapter


def _ids(batch=2, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, SEQ))


@pytest.mark.parametrize("scan_layers, lora", [
    (False, LoRA(rank=4, alpha=8.0, targets=(*PROJECTIONS, "gate", "tokens", "head"))),
    pytest.param(True, LoRA(rank=3, alpha=5.0, targets=PROJECTIONS, rslora=True),
                 marks=pytest.mark.slow),  # stacked layers compile their own scan: ~10 s
], ids=["all-targets", "scan-rslora"])
def test_peft_model_matches_tfx_lora(tmp_path, scan_layers, lora):
    model = _with_lora(_llama().replace(compute={"scan_layers": scan_layers}), lora)
    base, adapter = _export(model, tmp_path, LLAMA)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ids = _ids()
    with torch.no_grad():
        theirs = peft_model(input_ids=torch.tensor(ids)).logits.numpy()
    ours = np.asarray(model(ids))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    # The adapter really changes the output (a silently dropped factor would not).
    with peft_model.disable_adapter(), torch.no_grad():
        plain = peft_model(input_ids=torch.tensor(ids)).logits.numpy()
    assert np.abs(plain - theirs).max() > 1e-2


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
    hf = transformers.AutoModel.from_pretrained(base, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ids = _ids()
    with torch.no_grad():
        theirs = peft_model(input_ids=torch.tensor(ids)).last_hidden_state.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), theirs, atol=1e-4, rtol=1e-4)


def test_errors(tmp_path):
    plain = create(_llama(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no LoRA factors"):
        save_peft_adapter(plain, tmp_path, architecture=LLAMA)
    adapted = _with_lora(_llama(), LoRA(rank=2))
    with pytest.raises(ValueError, match=r"architecture must be one of .*LlamaForCausalLM"):
        save_peft_adapter(adapted, tmp_path, architecture="GPT2LMHeadModel")
    tied = _with_lora(_llama(tie_word_embeddings=True), LoRA(rank=2, targets=("tokens",)))
    with pytest.raises(ValueError, match="tied token embeddings"):
        save_peft_adapter(tied, tmp_path, architecture=LLAMA)
    moe = _llama().replace(moe={"num_experts": 4})
    routed = _with_lora(moe, LoRA(rank=2, targets=("query", "router")))
    with pytest.raises(ValueError, match="mlp/router have no MixtralForCausalLM module"):
        save_peft_adapter(routed, tmp_path, architecture="MixtralForCausalLM")
    with pytest.raises(TypeError, match="base_model"):
        save_peft_adapter(adapted, tmp_path, architecture=LLAMA, base_model=3)
    assert not list(tmp_path.iterdir())  # nothing written by a failed export
