"""peft adapters of the families added in 2026 (Qwen3-Next, Qwen3.5 dense and MoE, OLMo 3,
SmolLM3, Gemma 4, GPT-OSS, ModernBERT), both ways: a tiny transformers model written by
save_pretrained, loaded by `tfx.hf.load`, random LoRA factors on every target tfx offers there,
`save_peft_adapter`; then transformers + `peft.PeftModel.from_pretrained` must compute what the
tfx model computes, and `load_peft_adapter` must give back the same factors (fused modules
included: their rank-k·r block-diagonal LoRA is split back into the parts' rank-r ones).

The fused modules: both hybrids' gated q_proj (per head [query | gate], rank 2r), Qwen3-Next's
in_proj_qkvz (4r) and in_proj_ba (2r) per key head, Qwen3.5's in_proj_qkv (3r; in_proj_z, _b,
_a hold one part each), ModernBERT's Wqkv (3r) and Wi (2r). Sizes come from each family's own
parity test."""

import importlib.util
import json
import pathlib
import sys

import chex
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from causal_lm_parity import hf_causal_lm  # noqa: E402

import tfx.hf  # noqa: E402
from tfx.hf.peft_adapter import save_peft_adapter  # noqa: E402
from tfx.hf.peft_import import load_peft_adapter  # noqa: E402
from tfx.peft import LoRA, lora  # noqa: E402


def _sibling(name: str):
    """The test module tests/hf/`name`.py (pytest's importlib mode keeps tests/hf off the
    path), for its tiny configs and helpers."""
    path = pathlib.Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_peft_2026_{name}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


test_gemma4, test_gpt_oss, test_modernbert, test_olmo3, test_qwen3_5, test_qwen3_next, \
    test_smollm3, test_peft_adapter = map(_sibling, (
        "test_gemma4", "test_gpt_oss", "test_modernbert", "test_olmo3", "test_qwen3_5",
        "test_qwen3_next", "test_smollm3", "test_peft_adapter"))
_assert_peft_matches, _ids, _randomize = (test_peft_adapter._assert_peft_matches,
                                          test_peft_adapter._ids, test_peft_adapter._randomize)

# Every Gated DeltaNet projection and the full layers' (query, gate, key, value, out).
HYBRID = r".*attention/(query|key|value|gate|beta|decay|out)"
PLAIN = ("query", "key", "value", "out", "gate", "up", "down")
# family: (architecture, config.json fields, config class (None: the architecture's own),
# LoRA targets, rank, the fused modules' ranks (rank_pattern)). The shared experts' gate is a
# linear layer to one output, which allows rank 1 only.
FAMILIES = {
    # Qwen3-Next's MLPs (dense and shared experts) are refused: peft reads gate_proj, up_proj,
    # down_proj on it as the experts; its shared expert's gate is a linear layer of its own.
    "qwen3-next": ("Qwen3NextForCausalLM",
                   {**test_qwen3_next.BASE, **test_qwen3_next.CASES["sparse"]}, None,
                   rf"{HYBRID}|.*shared_gate|embeddings/tokens|head", 1,
                   {"q_proj": 2, "in_proj_qkvz": 4, "in_proj_ba": 2}),
    "qwen3.5": ("Qwen3_5ForCausalLM",
                {**test_qwen3_5.BASE, **test_qwen3_5.CASES["dense"][1]}, "Qwen3_5TextConfig",
                (*PLAIN, "beta", "decay", "tokens", "head"), 2, {"q_proj": 4, "in_proj_qkv": 6}),
    # Tied embeddings: no tokens; the shared expert's MLP is adapted (no peft conversion here).
    "qwen3.5-moe": ("Qwen3_5MoeForCausalLM",
                    {**test_qwen3_5.BASE, **test_qwen3_5.CASES["moe"][1]}, "Qwen3_5MoeTextConfig",
                    rf"{HYBRID}|.*shared_gate|.*shared/(gate|up|down)", 1,
                    {"q_proj": 2, "in_proj_qkv": 3}),
    "olmo3": ("Olmo3ForCausalLM", test_olmo3.CASES["yarn-full"], None,
              (*PLAIN, "tokens", "head"), 2, {}),
    "smollm3": ("SmolLM3ForCausalLM", test_smollm3.CASES["default"], None,
                (*PLAIN, "tokens", "head"), 2, {}),
    # The last two layers share the keys of earlier ones (no k_proj, v_proj); per-layer
    # embeddings: their table, projection and each layer's gate and up.
    "gemma4": ("Gemma4ForCausalLM", {**test_gemma4.BASE, **test_gemma4.CASES["ple_shared"]},
               "Gemma4TextConfig", (*PLAIN, "projection", "per_layer_embeddings/tokens"), 2, {}),
    "gpt-oss": ("GptOssForCausalLM", {**test_gpt_oss.BASE, **test_gpt_oss.CASES["yarn"]}, None,
                ("query", "key", "value", "out", "tokens", "head"), 2, {}),
    "modernbert": ("ModernBertModel", test_modernbert.CASES["biased"], None, PLAIN, 2,
                   {"Wqkv": 6, "Wi": 4}),
}


def _hf_folder(tmp_path, family: str):
    """The family's tiny transformers model, perturbed, saved by save_pretrained."""
    architecture, fields, config_class, *_ = FAMILIES[family]
    if architecture == "ModernBertModel":
        hf = test_modernbert._hf(architecture, fields)
    else:  # perturbed as in the parity tests: larger weights (and LoRA updates) make the
        # hybrids' delta rule amplify float32 rounding past the tolerance
        hf = hf_causal_lm(torch, transformers, architecture, fields, scale=0.1,
                          config_class=config_class and getattr(transformers, config_class))
    hf.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def _adapted(base, targets, rank: int = 2):
    """The tfx model of `base` with random LoRA factors (scale 1.5) on `targets`."""
    model = tfx.hf.load(base)
    model.eval()  # ModernBERT's dropout
    lora_ = LoRA(rank=rank, alpha=1.5 * rank, targets=targets)
    return _randomize(lora_.attach(model, rngs=nnx.Rngs(1)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_computes_what_tfx_computes_and_the_adapter_reads_back(tmp_path, family):
    architecture, _, _, targets, rank, fused_ranks = FAMILIES[family]
    base, adapter = _hf_folder(tmp_path, family), tmp_path / "adapter"
    model = _adapted(base, targets, rank)
    save_peft_adapter(model, adapter, architecture=architecture, base_model=str(base))
    output = "last_hidden_state" if architecture == "ModernBertModel" else "logits"
    ids = _ids()
    _assert_peft_matches(model, base, adapter, ids, output)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["rank_pattern"] == fused_ranks
    assert config["alpha_pattern"] == {name: 1.5 * r for name, r in fused_ranks.items()}

    fresh = tfx.hf.load(base)
    fresh.eval()
    loaded = load_peft_adapter(adapter, fresh, architecture=architecture)
    saved = lora.weights_of(model)
    assert loaded.scale == pytest.approx(saved.scale, rel=1e-12)
    chex.assert_trees_all_equal(loaded.factors, saved.factors)
    lora.attach(fresh, loaded)
    np.testing.assert_allclose(np.asarray(fresh(ids)), np.asarray(model(ids)), rtol=1e-5,
                               atol=1e-6)


def test_what_peft_cannot_target_is_refused_by_name(tmp_path):
    gpt_oss = _adapted(_hf_folder(tmp_path / "gpt-oss", "gpt-oss"), ("query", "router"))
    with pytest.raises(ValueError, match="mlp/router have no GptOssForCausalLM module"):
        save_peft_adapter(gpt_oss, tmp_path / "a", architecture="GptOssForCausalLM")
    qwen3_next = _adapted(_hf_folder(tmp_path / "qwen3-next", "qwen3-next"),
                          rf"{HYBRID}|.*layers/0/mlp/up")
    with pytest.raises(ValueError, match=r"layers/0/mlp/up .* peft reads a target named up_proj"):
        save_peft_adapter(qwen3_next, tmp_path / "a", architecture="Qwen3NextForCausalLM")
    assert not (tmp_path / "a").exists()  # nothing written by a failed export
