"""Gemma 4 text (`Gemma4ForCausalLM`, config model_type "gemma4_text") checkpoints <-> tfx
`Decoder` (card `tfx.models.families.GEMMA4`).

Gemma 4 is Gemma 3 (`tfx.hf.gemma`: sliding and full layers, four norms per layer, per-head
q/k norms, embeddings times sqrt(hidden_size), tanh-GELU gated MLP) with:

- RMSNorms that multiply by their weight (not 1 + weight): copied as they are.
- scores not scaled (1.0: attention.scale), values RMS-normalised per head without a scale
  (v_norm -> attention.value_norm), and each layer's output times a learned scalar
  (layer_scalar, a buffer saved with the weights -> norm.layer_scale, `layer_scale`).
- per-layer embeddings (hidden_size_per_layer_input > 0 -> embeddings.per_layer_width,
  vocab_size_per_layer_input -> per_layer_vocab_size): model.embed_tokens_per_layer,
  per_layer_model_projection and per_layer_projection_norm -> per_layer_embeddings/{tokens,
  projection, norm}; each layer's per_layer_input_gate, per_layer_projection and
  post_per_layer_input_norm -> per_layer_input/{gate, up, norm}.
- KV sharing: the last num_kv_shared_layers layers (attention.shared_kv_layers) have no
  k_proj, v_proj, k_norm (and attend the keys of the last earlier layer of their type).
- "full" layers with their own head width and KV heads: config.json's per_layer_config (by
  layer index: head_dim, num_key_value_heads; written by transformers from global_head_dim
  and, with attention_k_eq_v, num_global_key_value_heads) -> attention.full_head_dim and
  full_kv_heads; attention_k_eq_v -> attention.full_values_are_keys (no v_proj on full
  layers).
- rope_parameters by layer type: "sliding_attention" default rope -> rope.local_theta;
  "full_attention" default, or "proportional" (the first partial_rotary_factor of the rotation
  pairs turn, with the whole head's frequencies) -> rope.theta and rope.scaling
  (`tfx.ops.positional.ProportionalScaling`; None when it rotates everything
  unscaled).

The Hub's checkpoints are image-audio-text models: `Gemma4ForConditionalGeneration`
(`MULTIMODAL`) loads as its text model (`tfx.hf.families.TextOf`): text_config with the top
level's tie_word_embeddings, the tensors `model.language_model.*` (and `lm_head.weight` when
untied); the vision and audio towers and their embedders are not read, and such a model saves
as Gemma4ForCausalLM.

use_double_wide_mlp (MLPs of twice intermediate_size on the kv-shared layers) ->
mlp.wide_shared.

Refused (ValueError naming the field): enable_moe_block (the experts beside the MLP),
another hidden_activation, attention_bias,
use_bidirectional_attention, sliding_window None, per_layer_config entries other than the
full layers' head_dim / num_key_value_heads (alike on every full layer), other rope types;
on export, configs outside the card.
"""

from __future__ import annotations

import numpy as np

from tfx.hf import decoder_parts, gemma, plan
from tfx.hf.families import Multimodal
from tfx.models import families
from tfx.models.config import DecoderConfig
from tfx.ops.positional import ProportionalScaling

__all__ = ["ARCHITECTURES", "CARDS", "IGNORED", "MULTIMODAL", "OPTIONAL_PARAMS",
           "config_from_hf", "config_to_hf", "params_from_hf", "params_to_hf", "steps",
           "tensor_names"]

GEMMA4 = "Gemma4ForCausalLM"
ARCHITECTURES = (GEMMA4,)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = decoder_parts.IGNORED
CARDS = {GEMMA4: families.GEMMA4}
# The image-audio-text model whose text model this is (tfx.hf.families.for_loading).
MULTIMODAL = {"Gemma4ForConditionalGeneration": Multimodal(
    GEMMA4, {"model.language_model.": "model.", "lm_head.": "lm_head."},
    ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."),
    tie_word_embeddings=True)}

_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
# Gemma4TextConfig's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(vocab_size=262144, hidden_size=2304, intermediate_size=9216,
                 num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                 hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
                 rms_norm_eps=1e-6, pad_token_id=0, tie_word_embeddings=True,
                 attention_bias=False, sliding_window=512, final_logit_softcapping=None,
                 use_bidirectional_attention=None, vocab_size_per_layer_input=262144,
                 hidden_size_per_layer_input=256, attention_k_eq_v=False, num_kv_shared_layers=0,
                 enable_moe_block=False, use_double_wide_mlp=False, global_head_dim=512,
                 num_global_key_value_heads=None)
_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                            "rope_theta": 1_000_000.0}}


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """Gemma4TextConfig fields (config.json as a dict) -> DecoderConfig; dropout off."""
    hf = {**_DEFAULTS, **hf}
    _check_supported(hf, architecture)
    kinds = _layer_types(hf)
    width = hf["hidden_size_per_layer_input"] or None  # 0 / None: no per-layer embeddings
    fields = {**decoder_parts.common_fields(hf), **_rope_from_hf(hf, architecture),
              **_full_layers(hf, kinds, architecture),
              "attention.sliding_window": hf["sliding_window"],
              "attention.layer_types": tuple(_LAYER_TYPES[kind] for kind in kinds),
              "attention.shared_kv_layers": hf["num_kv_shared_layers"],
              # Only the kv-shared layers' MLPs widen: without them the flag means nothing.
              "mlp.wide_shared": bool(hf["use_double_wide_mlp"] and hf["num_kv_shared_layers"]),
              "embeddings.per_layer_width": width,
              "embeddings.per_layer_vocab_size": hf["vocab_size_per_layer_input"] if width
              else None,
              "logit_softcap": hf["final_logit_softcapping"]}
    return decoder_parts.from_card(CARDS[architecture], fields)


def _check_supported(hf: dict, architecture: str) -> None:
    """ValueError for the settings of `hf` (defaults filled in) that tfx does not map."""
    refused = {
        "enable_moe_block": hf["enable_moe_block"],
        "attention_bias": hf["attention_bias"],
        "use_bidirectional_attention": hf["use_bidirectional_attention"],
        "hidden_activation": hf["hidden_activation"] != "gelu_pytorch_tanh",
        "sliding_window": hf["sliding_window"] is None,
    }
    for name, bad in refused.items():
        if bad:
            raise ValueError(f"{architecture}: {name}={hf[name]!r} is not supported (tfx maps "
                             "dense gated 'gelu_pytorch_tanh' causal decoders without "
                             "attention biases, with a sliding window)")


def _layer_types(hf: dict) -> list[str]:
    """config.json's layer_types (default: every sixth layer full), the last forced to
    "full_attention" as transformers does."""
    kinds = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                      for i in range(hf["num_hidden_layers"])]
    unknown = sorted(set(kinds) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"{GEMMA4}: layer_types {unknown} are not supported; tfx maps "
                         f"{sorted(_LAYER_TYPES)}")
    return [*kinds[:-1], "full_attention"]


def _full_layers(hf: dict, kinds: list[str], architecture: str) -> dict:
    """attention.full_head_dim, full_kv_heads and full_values_are_keys from per_layer_config
    (or, absent, global_head_dim and num_global_key_value_heads, as transformers builds it)."""
    overrides = hf.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": hf["global_head_dim"]}
        if hf["attention_k_eq_v"] and hf["num_global_key_value_heads"] is not None:
            full["num_key_value_heads"] = hf["num_global_key_value_heads"]
        overrides = {i: full for i, kind in enumerate(kinds) if kind == "full_attention"}
    by_layer = {int(i): dict(fields) for i, fields in overrides.items()}
    full = [by_layer.get(i, {}) for i, kind in enumerate(kinds) if kind == "full_attention"]
    sliding = [by_layer.get(i) for i, kind in enumerate(kinds) if kind != "full_attention"]
    if any(sliding) or any(f != full[0] for f in full) or set(full[0]) - {
            "head_dim", "num_key_value_heads"}:
        raise ValueError(f"{architecture}: per_layer_config={overrides} is not supported (tfx "
                         "maps one head_dim / num_key_value_heads shared by the full layers)")
    head_dim, kv_heads = full[0].get("head_dim"), full[0].get("num_key_value_heads")
    return {"attention.full_head_dim": None if head_dim == hf["head_dim"] else head_dim,
            "attention.full_kv_heads": None if kv_heads == hf["num_key_value_heads"]
            else kv_heads,
            "attention.full_values_are_keys": bool(hf["attention_k_eq_v"])}


def _rope_from_hf(hf: dict, architecture: str) -> dict:
    """rope.theta, rope.scaling (None or proportional) and rope.local_theta."""
    by_type = hf.get("rope_parameters") or _ROPE
    if set(by_type) != set(_LAYER_TYPES):
        raise ValueError(f"{architecture}: rope_parameters must be keyed by layer type "
                         f"{sorted(_LAYER_TYPES)}, got {sorted(by_type)}")
    local, full = by_type["sliding_attention"], by_type["full_attention"]
    if local.get("rope_type", "default") != "default" or local.get(
            "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{architecture}: rope_parameters['sliding_attention']={local} is not "
                         "supported (tfx's sliding layers rotate whole heads, unscaled)")
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ValueError(f"{architecture}: rope_parameters['full_attention'] rope_type="
                         f"{kind!r} is not supported (tfx maps 'default' and 'proportional')")
    fraction = full.get("partial_rotary_factor", 1.0)
    factor = full.get("factor", 1.0) if kind == "proportional" else 1.0
    if kind == "default" and fraction != 1.0:
        raise ValueError(f"{architecture}: partial_rotary_factor={fraction} with the default "
                         "rope is not supported (transformers' default rope rotates the head)")
    scaling = None if (fraction, factor) == (1.0, 1.0) else ProportionalScaling(fraction, factor)
    theta = {kind: float(by_type[kind].get("rope_theta", _ROPE[kind]["rope_theta"]))
             for kind in _ROPE}  # transformers' bases where a layer type names none
    return {"rope.theta": theta["full_attention"], "rope.scaling": scaling,
            "rope.local_theta": theta["sliding_attention"]}


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> Gemma4TextConfig fields; ValueError for what they cannot express."""
    decoder_parts.check_card(config, architecture, CARDS[architecture])
    c, a = config, config.attention
    if c.rope.local_theta is None or a.sliding_window is None:
        raise ValueError(f"{architecture} needs rope.local_theta and attention.sliding_window "
                         "(its sliding layers rotate with a base of their own, in a window)")
    kinds = [c.layer_type(i) for i in range(c.num_layers)]
    if kinds[-1] != "full":
        raise ValueError(f"{architecture} needs a last layer of type 'full' (transformers makes "
                         f"it so), got attention.layer_types={a.layer_types}")
    hf = decoder_parts.common_fields_to_hf(c, architecture, "gemma4_text")
    width = c.embeddings.per_layer_width
    kv_heads, head_dim = c.layer_heads("full")
    hf.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
              final_logit_softcapping=c.logit_softcap, sliding_window=a.sliding_window,
              layer_types=[f"{kind}_attention" for kind in kinds],
              hidden_size_per_layer_input=width or 0,
              vocab_size_per_layer_input=c.embeddings.per_layer_vocab_size or c.vocab_size,
              num_kv_shared_layers=a.shared_kv_layers, attention_k_eq_v=a.full_values_are_keys,
              enable_moe_block=False, use_double_wide_mlp=c.mlp.wide_shared,
              per_layer_config={str(i): {"head_dim": head_dim, "num_key_value_heads": kv_heads}
                                for i, kind in enumerate(kinds) if kind == "full"},
              rope_parameters={"full_attention": _full_rope_to_hf(c, architecture),
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": c.rope.local_theta}})
    return hf


def _full_rope_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """The full layers' rope_parameters: default, or proportional for a ProportionalScaling."""
    scaling = config.rope.scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope.theta}
    if not isinstance(scaling, ProportionalScaling):
        raise ValueError(f"{architecture} cannot express rope.scaling={scaling!r} (its full "
                         "layers have the default or the proportional rope)")
    rope = {"rope_type": "proportional", "rope_theta": config.rope.theta,
            "partial_rotary_factor": scaling.fraction}
    # transformers reads a factor but warns of one its validation does not list: only if set.
    return rope if scaling.factor == 1.0 else {**rope, "factor": scaling.factor}


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """Gemma4ForCausalLM tensors -> tfx parameters by state path (every tensor accounted
    for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`):
    linear weights are transposed, everything else copied (norm weights are the scales)."""
    return decoder_parts.steps(names, config, tensor_names(config))


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> HF tensors (lm_head left out when tied)."""
    return decoder_parts.params_to_hf(params, config, tensor_names(config))


def tensor_names(config: DecoderConfig) -> dict[tuple, str]:
    """tfx path -> HF tensor name, for every parameter of the model."""
    names = gemma.tensor_names(config)  # Gemma 3's, all layers with keys and values
    sources = [None] * (config.num_layers - config.attention.shared_kv_layers)
    sources += [True] * config.attention.shared_kv_layers
    for i, shared in enumerate(sources):
        layer, hf = ("stack", "layers", i), f"model.layers.{i}"
        gone = ["key", "value", "key_norm"] if shared else (
            ["value"] if config.layer_type(i) == "full"
            and config.attention.full_values_are_keys else [])
        names = {path: name for path, name in names.items()
                 if path[:5] not in {(*layer, "attention", part) for part in gone}}
        names[(*layer, "layer_scale")] = f"{hf}.layer_scalar"
        if config.embeddings.per_layer_width:
            for ours, theirs in (("gate", "per_layer_input_gate"), ("up", "per_layer_projection")):
                names[(*layer, "per_layer_input", ours, "kernel")] = f"{hf}.{theirs}.weight"
            names[(*layer, "per_layer_input", "norm", "scale")] = \
                f"{hf}.post_per_layer_input_norm.weight"
    if config.embeddings.per_layer_width:
        names[("per_layer_embeddings", "tokens", "table")] = "model.embed_tokens_per_layer.weight"
        names[("per_layer_embeddings", "projection", "kernel")] = \
            "model.per_layer_model_projection.weight"
        names[("per_layer_embeddings", "norm", "scale")] = "model.per_layer_projection_norm.weight"
    return names
