"""Qwen3.5 text models (`Qwen3_5ForCausalLM`, dense, and `Qwen3_5MoeForCausalLM`) checkpoints
<-> tfx `Decoder`.

Qwen3.5 is Qwen3-Next (`tfx.hf.qwen3_next`: Gated DeltaNet and gated full-attention layers,
(1 + weight) RMSNorms, a quarter of each head rotated) with the Gated DeltaNet's input
projections kept apart: `linear_attn.in_proj_qkv` (rows [query | key | value]) -> attention/
query, key, value; `in_proj_z` -> gate, `in_proj_b` -> beta, `in_proj_a` -> decay. Its cards:
`tfx.models.families.QWEN3_5` and `QWEN3_5_MOE`.

- Qwen3_5ForCausalLM: a SwiGLU MLP of width intermediate_size in every layer.
- Qwen3_5MoeForCausalLM: experts in every layer (no decoder_sparse_step, mlp_only_layers or
  norm_topk_prob: a softmax top-k router always renormalised over the k), of width
  moe_intermediate_size, with Qwen3-Next's gated shared expert of width
  shared_expert_intermediate_size (a multiple of moe_intermediate_size). Its config has no
  intermediate_size: tfx's d_ff (unused, no layer is dense) is moe_intermediate_size unless
  config.json names one.

Rotary positions: the text models rotate with multimodal sections (rope_parameters'
mrope_section), which for text, whose three position components are equal, is plain rotary
over the partial_rotary_factor of each head; the section fields are not read.
The checkpoints the Hub has, `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration` (`MULTIMODAL`), load as their text model
(`tfx.hf.families.TextOf`): config.json's text_config (with the top level's
tie_word_embeddings), the tensors `model.language_model.*` and `lm_head.weight`; the vision
tower (`model.visual.*`) is not read, and such a model saves as the text class
(Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM). The multi-token-prediction tensors (`mtp.*`) are
not read, as transformers does not read them.

Refused (ValueError naming the field): what `tfx.hf.qwen3_next` refuses; on save, what the
card lacks.
"""

from __future__ import annotations

import numpy as np

from tfx.hf import decoder_parts, plan, qwen3_next
from tfx.hf.families import Multimodal
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "CARDS", "HAS_EXPERTS", "IGNORED", "MULTIMODAL", "OPTIONAL_PARAMS",
           "config_from_hf", "config_to_hf", "params_from_hf", "params_to_hf", "steps"]

QWEN3_5, QWEN3_5_MOE = "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"
ARCHITECTURES = (QWEN3_5, QWEN3_5_MOE)
HAS_EXPERTS = True  # Qwen3_5MoeForCausalLM's models have experts, `moe` (tfx.hf.save)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = qwen3_next.IGNORED  # rotary buffers, the multi-token-prediction head
# What every model of each architecture is (tfx.models.families): set on load, checked on save.
CARDS = {QWEN3_5: families.QWEN3_5, QWEN3_5_MOE: families.QWEN3_5_MOE}
# The image-text models whose text model is one of these (tfx.hf.families.for_loading).
_TEXT_TENSORS = {"model.language_model.": "model.", "lm_head.": "lm_head."}
MULTIMODAL = {
    f"{name}ForConditionalGeneration": Multimodal(text, _TEXT_TENSORS, ("model.visual.",),
                                                    tie_word_embeddings=False)
    for name, text in (("Qwen3_5", QWEN3_5), ("Qwen3_5Moe", QWEN3_5_MOE))}

_MODEL_TYPES = {QWEN3_5: "qwen3_5_text", QWEN3_5_MOE: "qwen3_5_moe_text"}
# The config classes' defaults, for config.json files that leave a field out.
_DEFAULTS = {
    QWEN3_5: dict(qwen3_next.HYBRID_DEFAULTS, vocab_size=248320, hidden_size=4096,
                  intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                  num_key_value_heads=4),
    QWEN3_5_MOE: dict(qwen3_next.HYBRID_DEFAULTS, vocab_size=248320, hidden_size=2048,
                      num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                      moe_intermediate_size=512, shared_expert_intermediate_size=512,
                      num_experts_per_tok=8, num_experts=256, router_aux_loss_coef=0.001),
}


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """Qwen3_5TextConfig / Qwen3_5MoeTextConfig fields (config.json as a dict) ->
    DecoderConfig; dropout off."""
    hf = {**_DEFAULTS[architecture], **hf}
    if architecture == QWEN3_5:
        return decoder_parts.from_card(CARDS[architecture],
                                       qwen3_next.hybrid_fields(hf, architecture))
    hf.setdefault("intermediate_size", hf["moe_intermediate_size"])
    experts, k = hf["num_experts"], hf["num_experts_per_tok"]
    if not (isinstance(experts, int) and isinstance(k, int) and 1 <= k <= experts):
        raise ValueError(f"{architecture}: num_experts_per_tok must be in [1, num_experts="
                         f"{experts}], got {k}")
    return decoder_parts.from_card(CARDS[architecture], {
        **qwen3_next.hybrid_fields(hf, architecture),
        "moe.num_experts": experts, "moe.experts_per_token": k,
        "moe.d_ff": hf["moe_intermediate_size"],
        "moe.shared_experts": qwen3_next.shared_experts(hf, architecture), "moe.jitter": 0.0})


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> Qwen3_5TextConfig / Qwen3_5MoeTextConfig fields; ValueError for what
    they cannot express."""
    hf = qwen3_next.hybrid_to_hf(config, architecture, CARDS[architecture],
                                 _MODEL_TYPES[architecture])
    return hf if architecture == QWEN3_5 else hf | qwen3_next.moe_to_hf(config)


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM tensors -> tfx parameters by state path
    (every tensor accounted for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`)."""
    return qwen3_next.hybrid_steps(names, config, fused=False)


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> the tensors save_pretrained writes (one per expert;
    lm_head left out when tied)."""
    return qwen3_next.hybrid_tensors(params, config, fused=False)
