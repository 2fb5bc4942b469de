"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 text (`Gemma3ForCausalLM`) checkpoints <-> tfx
`Decoder`.

Both are LLaMA-style decoders (grouped-query attention, "half" rotary layout, torch [out, in]
weights transposed into nnx kernels, see `tfx.hf.llama`) with:

- RMSNorm that multiplies by (1 + weight): tfx's RMSNorm multiplies by its scale, so loading
  sets scale = 1 + weight and saving writes weight = scale - 1. Both are computed in float32,
  as transformers computes 1 + weight.float(), so float32 parameters give the very multiplier
  transformers uses (and scale - 1 is exact for scales in [0.5, 2], Sterbenz). With bfloat16
  parameters the scale itself is rounded to bfloat16, a little coarser than transformers'
  float32 1 + weight.
- a norm on each branch's input and output: input_layernorm -> attention_norm,
  post_attention_layernorm -> attention_output_norm, pre_feedforward_layernorm -> mlp_norm,
  post_feedforward_layernorm -> mlp_output_norm (norm.outputs=True); model.norm ->
  stack/final_norm.
- token embeddings times sqrt(hidden_size) (embeddings.scale; the factor is cast to the
  activations' dtype, as transformers casts it to the weights'), tied to the head by default.
- a gated MLP with the tanh GELU (hidden_activation "gelu_pytorch_tanh" -> mlp.activation
  "gelu_tanh"), no biases anywhere (attention_bias must be false).
- scores scaled by query_pre_attn_scalar**-0.5 (attention.scale), with head_dim independent of
  the width.
- sliding and full layers: layer_types ("sliding_attention" / "full_attention"; when absent,
  Gemma 2 alternates sliding, full, ... and Gemma 3 makes every sliding_window_pattern-th layer
  full, 6 by default) -> attention.layer_types ("sliding" / "full") with
  attention.sliding_window. tfx decodes with one linear KV cache and a window mask per sliding
  layer where transformers keeps sliding-window caches; the tokens are the same.
- final_logit_softcapping -> logit_softcap.

Gemma 2 also soft-caps the attention scores (attn_logit_softcapping -> attention.softcap); one
rope_parameters (or legacy rope_theta / rope_scaling) serves every layer, as in `tfx.hf.llama`.

Gemma 3 normalises each head's queries and keys (q_norm, k_norm: RMSNorm (1 + weight) over
head_dim -> attention.qk_norm "per_head", attention/query_norm/norm/scale and key_norm). Its
rope_parameters are keyed by layer type: "full_attention" (rope_theta, default 1e6, and a
scaling such as linear) -> rope.theta and rope.scaling; "sliding_attention" (default rope,
rope_theta default 1e4) -> rope.local_theta. Older configs say rope_theta,
rope_local_base_freq and rope_scaling (applied to the full layers). transformers' Gemma 3
attention ignores attn_logit_softcapping, so a config that sets it is refused rather than read
two ways. Gemma3ForConditionalGeneration checkpoints (the Hub's Gemma 3 of 4B and up,
`MULTIMODAL`) load as their text model (`tfx.hf.families.TextOf`): text_config, with the top
level's tie_word_embeddings, and the tensors `language_model.model.*` /
`language_model.lm_head.weight` (what save_pretrained writes) or `model.language_model.*` /
`lm_head.weight` (transformers' module names); the vision tower and projector are not read,
and such a model saves as Gemma3ForCausalLM.

Refused (ValueError naming the field): another hidden_activation, attention_bias,
use_bidirectional_attention, sliding_window None (transformers' Gemma cannot run without one),
layer types other than the two, partial rotary factors, rope types tfx lacks, and a scaled
rope on Gemma 3's sliding layers; on export, configs outside all this (e.g. no norm.outputs,
an attention.scale that is no integer's **-0.5, Gemma 3 without rope.local_theta).
"""

from __future__ import annotations

import math

import numpy as np

from tfx.hf import decoder_parts, plan
from tfx.hf.families import Multimodal
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "CARDS", "IGNORED", "MULTIMODAL", "OPTIONAL_PARAMS", "config_from_hf",
           "config_to_hf", "params_from_hf", "params_to_hf", "scale_from_weight", "steps",
           "tensor_names", "tensor_to_hf"]

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
ARCHITECTURES = (GEMMA2, GEMMA3)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = decoder_parts.IGNORED  # rotary frequency buffers of older checkpoints
# What every Gemma 2 / 3 is (tfx.models.families): set on load, checked on save.
CARDS = {GEMMA2: families.GEMMA2, GEMMA3: families.GEMMA3}
# The image-text model whose text model is Gemma 3 (tfx.hf.families.for_loading).
MULTIMODAL = {"Gemma3ForConditionalGeneration": Multimodal(GEMMA3, {
    "language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.", "lm_head.": "lm_head."}, (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.",
    "model.multi_modal_projector."), tie_word_embeddings=True)}

_MODEL_TYPES = {GEMMA2: "gemma2", GEMMA3: "gemma3_text"}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_HF_LAYER_TYPES = {kind: name for name, kind in _LAYER_TYPES.items()}
# The config classes' defaults, for config.json files that leave a field out.
_COMMON = dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256,
               hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, pad_token_id=0,
               tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
               sliding_window=4096, use_bidirectional_attention=False)
_DEFAULTS = {
    GEMMA2: dict(_COMMON, vocab_size=256000, max_position_embeddings=8192,
                 final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    GEMMA3: dict(_COMMON, vocab_size=262208, max_position_embeddings=131072,
                 final_logit_softcapping=None, attn_logit_softcapping=None),
}
# Gemma 3's rope_theta of full and sliding layers when the config names none.
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """Gemma2Config / Gemma3TextConfig fields (config.json as a dict) -> DecoderConfig;
    dropout off."""
    hf = {**_DEFAULTS[architecture], **hf}
    _check_supported(hf, architecture)
    fields = {**decoder_parts.common_fields(hf), **_rope_from_hf(hf, architecture),
              "attention.scale": float(hf["query_pre_attn_scalar"]) ** -0.5,
              "attention.sliding_window": hf["sliding_window"],
              "attention.layer_types": _layer_types(hf, architecture),
              "logit_softcap": hf["final_logit_softcapping"]}
    if architecture == GEMMA2:  # Gemma 3's card fixes it: no score cap
        fields["attention.softcap"] = hf["attn_logit_softcapping"]
    return decoder_parts.from_card(CARDS[architecture], fields)


def _check_supported(hf: dict, architecture: str) -> None:
    """ValueError for the settings of `hf` (defaults filled in) that tfx does not map."""
    if hf["hidden_activation"] != "gelu_pytorch_tanh":
        raise ValueError(f"{architecture}: hidden_activation={hf['hidden_activation']!r} is not "
                         "supported (tfx maps the gated 'gelu_pytorch_tanh' MLP)")
    if hf["attention_bias"]:
        # Biases on q, k, v and o but not the MLP: tfx has them on q, k, v or everywhere.
        raise ValueError(f"{architecture}: attention_bias=True is not supported")
    if hf["sliding_window"] is None:
        # transformers builds the sliding layers' mask whatever the layer types, and fails.
        raise ValueError(f"{architecture}: sliding_window=None is not supported (transformers' "
                         "Gemma needs a window, used by the 'sliding_attention' layers)")
    if hf["use_bidirectional_attention"]:
        raise ValueError(f"{architecture}: use_bidirectional_attention=True is not supported "
                         "(tfx decoders are causal)")
    if architecture == GEMMA3 and hf["attn_logit_softcapping"] is not None:
        raise ValueError(f"{architecture}: attn_logit_softcapping="
                         f"{hf['attn_logit_softcapping']} is not supported: transformers' Gemma 3 "
                         "attention ignores it (Gemma 2 applies it)")


def _layer_types(hf: dict, architecture: str) -> tuple[str, ...]:
    """config.json's layer_types, or the default pattern of the architecture, in tfx terms."""
    kinds = hf.get("layer_types")
    if kinds is None:
        every = 2 if architecture == GEMMA2 else hf.get("sliding_window_pattern", 6)
        kinds = ["sliding_attention" if (i + 1) % every else "full_attention"
                 for i in range(hf["num_hidden_layers"])]
    unknown = sorted(set(kinds) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"{architecture}: layer_types {unknown} are not supported; tfx maps "
                         f"{sorted(_LAYER_TYPES)}")
    return tuple(_LAYER_TYPES[kind] for kind in kinds)


def _rope_from_hf(hf: dict, architecture: str) -> dict:
    """rope.theta, rope.scaling and (Gemma 3) rope.local_theta, by dotted name."""
    max_len = hf["max_position_embeddings"]
    if architecture == GEMMA2:
        rope = decoder_parts.rope_parameters(hf)
        return {"rope.theta": float(rope.get("rope_theta", 10000.0)),
                "rope.scaling": decoder_parts.scaling_from_hf(rope, hf, max_len, architecture)}
    by_type = hf.get("rope_parameters") or {}
    if not set(by_type) <= set(_LAYER_TYPES):
        raise ValueError(f"{architecture}: rope_parameters must be keyed by layer type "
                         f"{sorted(_LAYER_TYPES)}, got {sorted(by_type)}")
    # transformers: a legacy rope_scaling updates the full layers' settings.
    full = _layer_rope(hf, {**(by_type.get("full_attention") or {}),
                            **(hf.get("rope_scaling") or {})}, "full_attention", "rope_theta")
    local = _layer_rope(hf, by_type.get("sliding_attention"), "sliding_attention",
                        "rope_local_base_freq")
    if local["rope_type"] != "default" or local.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{architecture}: rope_parameters['sliding_attention']={local} is not "
                         "supported (tfx's sliding layers rotate with their own rope_theta, "
                         "unscaled)")
    return {"rope.theta": float(full["rope_theta"]),
            "rope.scaling": decoder_parts.scaling_from_hf(full, hf, max_len, architecture),
            "rope.local_theta": float(local["rope_theta"])}


def _layer_rope(hf: dict, settings: dict | None, layer_type: str, theta_field: str) -> dict:
    """One Gemma 3 layer type's flat rope settings, its rope_theta defaulting to the legacy
    top-level `theta_field`, then to the architecture's default."""
    theta = hf.get(theta_field)
    return decoder_parts.rope_parameters({
        "rope_parameters": settings, "partial_rotary_factor": hf.get("partial_rotary_factor"),
        "rope_theta": _GEMMA3_THETA[layer_type] if theta is None else theta})


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> Gemma2Config / Gemma3TextConfig fields; ValueError for what they cannot
    express."""
    decoder_parts.check_card(config, architecture, CARDS[architecture])
    if config.attention.sliding_window is None:
        raise ValueError(f"{architecture} needs attention.sliding_window (transformers builds "
                         "the sliding layers' mask whatever the layer types)")
    hf = decoder_parts.common_fields_to_hf(config, architecture, _MODEL_TYPES[architecture])
    hf.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
              use_bidirectional_attention=False,
              query_pre_attn_scalar=_pre_attn_scalar(config, architecture),
              attn_logit_softcapping=config.attention.softcap,
              final_logit_softcapping=config.logit_softcap,
              sliding_window=config.attention.sliding_window,
              layer_types=[_HF_LAYER_TYPES[config.layer_type(i)]
                           for i in range(config.num_layers)],
              rope_parameters=_rope_to_hf(config, architecture))
    return hf


def _pre_attn_scalar(config: DecoderConfig, architecture: str) -> int:
    """query_pre_attn_scalar, an integer whose **-0.5 is attention.scale."""
    head_dim = config.attention.head_dim or config.d_model // config.num_heads
    scale = config.attention.scale
    if scale is None:  # tfx's default, 1 / sqrt(head_dim)
        return head_dim
    scalar = round(scale**-2)
    if scalar < 1 or not math.isclose(scalar**-0.5, scale, rel_tol=1e-9):
        raise ValueError(f"{architecture} cannot express attention.scale={scale} (it scales by "
                         "query_pre_attn_scalar**-0.5, query_pre_attn_scalar an integer)")
    return scalar


def _rope_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """rope_parameters: one dict (Gemma 2) or one per layer type (Gemma 3)."""
    rope = decoder_parts.scaling_to_hf(config, architecture)
    if architecture == GEMMA2:
        return rope
    if config.rope.local_theta is None:
        raise ValueError(f"{architecture} needs rope.local_theta (its sliding layers rotate "
                         "with a base of their own, unscaled)")
    return {"full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": config.rope.local_theta}}


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """Gemma2ForCausalLM / Gemma3ForCausalLM tensors -> tfx parameters by state path (every
    tensor accounted for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`):
    norm weights become scales 1 + weight, linear weights are transposed."""
    out = [plan.Step((path,), (name,), scale_from_weight) if path[-1] == "scale"
           else plan.copy(path, name, transpose=path[-1] == "kernel")
           for path, name in tensor_names(config).items()]
    if config.embeddings.tie and "lm_head.weight" in names:  # a copy: checked, not used
        out.append(plan.tied("lm_head.weight", "model.embed_tokens.weight"))
    return out


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> HF tensors (lm_head left out when tied, as
    save_pretrained does)."""
    return {name: tensor_to_hf(path, params[path]) for path, name in tensor_names(config).items()}


def scale_from_weight(weight: np.ndarray) -> tuple[np.ndarray]:
    """An HF (1 + w) RMSNorm weight w (Gemma, Qwen3-Next) -> the tfx scale 1 + w, computed in
    float32 as transformers computes it."""
    return (np.asarray(weight, np.float32) + np.float32(1),)


def tensor_to_hf(path: tuple, value: np.ndarray) -> np.ndarray:
    """A tfx parameter at `path` -> its HF tensor: a (1 + w) norm's scale back to w, in the
    parameter's dtype; a kernel transposed."""
    if path[-1] == "scale":  # the inverse of scale_from_weight, in the parameter's dtype
        return (np.asarray(value, np.float32) - np.float32(1)).astype(value.dtype)
    return value.T if path[-1] == "kernel" else value  # nn.Linear weights are [out, in]


def tensor_names(config: DecoderConfig) -> dict[tuple, str]:
    """tfx path -> HF tensor name, for every parameter of the model."""
    # Embeddings, head, projections, q/k norms, input and final norms.
    names = decoder_parts.tensor_names(config)
    for i in range(config.num_layers):
        layer, hf = ("stack", "layers", i), f"model.layers.{i}"
        # Gemma's post_attention_layernorm is the attention's output norm (LLaMA's mlp_norm).
        names[(*layer, "attention_output_norm", "scale")] = f"{hf}.post_attention_layernorm.weight"
        names[(*layer, "mlp_norm", "scale")] = f"{hf}.pre_feedforward_layernorm.weight"
        names[(*layer, "mlp_output_norm", "scale")] = f"{hf}.post_feedforward_layernorm.weight"
    return names
