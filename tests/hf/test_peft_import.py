"""Reading peft LoRA adapters: `load_peft_adapter` gives back the factors `save_peft_adapter`
wrote (layers stacked or not), and the factors of an adapter that peft itself trained and saved
make the tfx model compute what the PeftModel computes (rank_pattern, alpha_pattern, rsLoRA,
layers_to_transform, embeddings); bad folders are refused naming what is wrong."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import tfx.hf
from tfx.hf import llama
from tfx.hf.peft_adapter import save_peft_adapter
from tfx.hf.peft_import import load_peft_adapter
from tfx.models import create
from tfx.peft import LoRA, PeftParam, lora

LLAMA = "LlamaForCausalLM"
TINY_LLAMA = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
TARGETS = ("query", "key", "value", "out", "gate", "up", "down", "tokens", "head")


def _model(scan_layers=False, **fields):
    config = llama.config_from_hf({**TINY_LLAMA, **fields}, LLAMA)
    return create(config.replace(compute={"scan_layers": scan_layers}), rngs=nnx.Rngs(0))


def _saved(tmp_path, model, targets=TARGETS, architecture=LLAMA, **settings):
    """`model` with random LoRA factors on `targets`, its adapter written to tmp_path/adapter."""
    LoRA(rank=3, alpha=5.0, targets=targets, **settings).attach(model, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype),
                                   nnx.state(model, PeftParam)))
    save_peft_adapter(model, tmp_path / "adapter", architecture=architecture)
    return tmp_path / "adapter"


@pytest.mark.parametrize("scan_layers, rslora", [(False, False), (True, True)])
def test_round_trip_gives_back_the_saved_factors(tmp_path, scan_layers, rslora):
    model = _model(scan_layers)
    folder = _saved(tmp_path, model, rslora=rslora)
    loaded = load_peft_adapter(folder, _model(scan_layers))
    saved = lora.weights_of(model)
    assert loaded.scale == pytest.approx(saved.scale, rel=1e-12)
    chex.assert_trees_all_equal(loaded.factors, saved.factors)
    assert load_peft_adapter(str(folder), _model(scan_layers), architecture="MistralForCausalLM"
                             ).factors.keys() == saved.factors.keys()


def _folder(tmp_path, config: dict, tensors: dict):
    folder = tmp_path / "bad"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_bad_folders_are_refused_naming_the_file_module_or_setting(tmp_path):
    folder = _saved(tmp_path, _model(), targets=("query", "down"))
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(folder / "adapter_model.safetensors")
    model = _model()
    with pytest.raises(ValueError, match=r"adapter_config\.json is missing"):
        load_peft_adapter(tmp_path, model)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is missing"):
        load_peft_adapter(tmp_path, model)
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        load_peft_adapter(_folder(tmp_path, {**config, "use_dora": True}, tensors), model)
    with pytest.raises(ValueError, match="peft_type must be \"LORA\""):
        load_peft_adapter(_folder(tmp_path, {**config, "peft_type": "IA3"}, tensors), model)
    renamed = {k.replace("q_proj", "x_proj"): v for k, v in tensors.items()}
    with pytest.raises(ValueError, match=r"module model\.layers\.0\.self_attn\.x_proj is not a "
                                         r"LlamaForCausalLM module"):
        load_peft_adapter(_folder(tmp_path, config, renamed), model)
    with pytest.raises(ValueError, match="tensor 'extra' is no LoRA factor"):
        load_peft_adapter(_folder(tmp_path, config, {**tensors, "extra": np.zeros(1)}), model)
    only_a = {k: v for k, v in tensors.items() if "down_proj.lora_B" not in k}
    with pytest.raises(ValueError, match=r"down_proj has only \[.*lora_A\.weight'\]; LoRA needs"):
        load_peft_adapter(_folder(tmp_path, config, only_a), model)
    with pytest.raises(ValueError, match="the model is no Gemma2ForCausalLM"):
        load_peft_adapter(folder, model, architecture="Gemma2ForCausalLM")
    with pytest.raises(ValueError, match="architecture must be one of"):
        load_peft_adapter(folder, model, architecture="T5ForConditionalGeneration")
    with pytest.raises(ValueError, match=r"down_proj have shapes A \(3, 48\), B \(32, 3\); the "
                                         r"model's layer \(48 -> 48\)"):
        load_peft_adapter(folder, _model(hidden_size=48))
    with pytest.raises(TypeError, match="folder must be a str"):
        load_peft_adapter(None, model)


def test_fused_modules_load_and_tied_embeddings_are_refused(tmp_path):
    model = _model()  # Phi-3's qkv_proj: the query's block of a rank-3r LoRA, split back
    folder = _saved(tmp_path, model, targets=("query",), architecture="Phi3ForCausalLM")
    chex.assert_trees_all_equal(load_peft_adapter(folder, _model()).factors,
                                lora.weights_of(model).factors)
    untied = _saved(tmp_path / "u", _model(), targets=("tokens",))
    with pytest.raises(ValueError, match="the tied token embeddings"):
        load_peft_adapter(untied, _model(tie_word_embeddings=True), architecture=LLAMA)


# peft's own adapters: the plain case, and one with per-module ranks and alphas, rsLoRA, a layer
# left out and layers stacked in tfx.
PEFT_CASES = {
    "plain": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj",
                                                      "embed_tokens", "lm_head"]), False),
    "patterns": (dict(r=4, lora_alpha=8, use_rslora=True, rank_pattern={"down_proj": 2},
                      alpha_pattern={"v_proj": 3}, layers_to_transform=[1],
                      target_modules=["q_proj", "v_proj", "down_proj"]), True),
}


@pytest.mark.parametrize("case", sorted(PEFT_CASES))
def test_adapter_saved_by_peft_computes_what_peft_computes(tmp_path, case):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from hf_folders import chat_model_folder

    settings, scan_layers = PEFT_CASES[case]
    base = chat_model_folder(torch, transformers, tmp_path / "base")
    hf = transformers.LlamaForCausalLM.from_pretrained(base, attn_implementation="eager")
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(**settings))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:  # B (and an embedding's A) start at zero
                torch.nn.init.normal_(param, std=0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 9))
    with torch.no_grad():
        theirs = peft_model.eval()(input_ids=torch.tensor(ids)).logits.numpy()
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=torch.tensor(ids)).logits.numpy()
    model = tfx.hf.load(base, compute={"scan_layers": scan_layers})
    lora.attach(model, tfx.hf.load_peft_adapter(tmp_path / "adapter", model))
    np.testing.assert_allclose(np.asarray(model(ids)), theirs, atol=1e-4, rtol=1e-4)
    assert np.abs(plain - theirs).max() > 1e-2
