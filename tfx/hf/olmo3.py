"""OLMo 3 (`Olmo3ForCausalLM`) checkpoints <-> tfx `Decoder`.

OLMo 3 is OLMo 2 (`tfx.hf.olmo2`: norms on the branch outputs only, q/k norms across heads,
attention_bias, the same config fields and tensor names, whose plan converts the tensors here)
with sliding and full layers and rope settings per layer kind (its card:
`tfx.models.families.OLMO3`, OLMo 2's with these fields freed):

- layer_types ("sliding_attention" / "full_attention"; when absent, three sliding layers then a
  full one, over and over) -> attention.layer_types ("sliding" / "full"), sliding_window ->
  attention.sliding_window. tfx decodes with one KV cache and a window mask per sliding layer
  where transformers keeps sliding-window caches; the tokens are the same.
- rope_parameters keyed by layer type. The full layers' -> rope.theta and rope.scaling (the
  types `tfx.hf.llama` maps); the sliding layers' -> the same when they are equal (the default),
  else their rope_theta -> rope.local_theta, with which tfx's sliding layers rotate unscaled: the
  long-context checkpoints, whose full layers alone have YaRN. Read as transformers' Olmo3Config
  resolves them: a legacy rope_scaling updates the full layers' settings, and a top-level
  rope_theta is taken by the full layers only (the sliding layers' default stays 500000).

Refused (ValueError naming the field): what OLMo 2 refuses (a hidden_act other than "silu",
partial_rotary_factor other than 1, rope types tfx lacks), rope_parameters keyed otherwise than
by layer type, a scaled rope on the sliding layers other than the full layers' own, layer types
other than the two or not one per layer, sliding_window None (transformers' OLMo 3 builds the
sliding layers' mask whatever the layer types, and fails); on save, what the card lacks and a
model without attention.sliding_window.
"""

from __future__ import annotations

from tfx.hf import decoder_parts, olmo2
from tfx.hf.olmo2 import params_from_hf, params_to_hf, steps, tensor_names
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
           "params_from_hf", "params_to_hf", "steps", "tensor_names"]

ARCHITECTURES = ("Olmo3ForCausalLM",)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = olmo2.IGNORED  # rotary frequency buffers of older checkpoints
CARD = families.OLMO3  # what every OLMo 3 is: set on load, checked on save

_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_HF_LAYER_TYPES = {kind: name for name, kind in _LAYER_TYPES.items()}
# Olmo3Config's defaults beyond Olmo2Config's (which tfx.hf.olmo2 fills in).
_DEFAULTS = dict(sliding_window=4096)
_THETA = 500000.0  # Olmo3Config's rope_theta of a layer type whose settings name none
_FULL_EVERY = 4  # Olmo3Config's default layer_types: every fourth layer is full


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """Olmo3Config fields (config.json as a dict) -> DecoderConfig; dropout off."""
    hf = {**_DEFAULTS, **hf}
    if hf["sliding_window"] is None:
        raise ValueError(f"{architecture}: sliding_window=None is not supported (transformers' "
                         "OLMo 3 needs a window, used by the 'sliding_attention' layers)")
    full, sliding = _rope_settings(hf, architecture)
    # An OLMo 2 whose rope is the full layers' (sizes, biases and OLMo 2's refusals), ...
    config = olmo2.config_from_hf({**hf, "rope_parameters": full, "rope_scaling": None},
                                  architecture)
    # ... with OLMo 3's windows and its sliding layers' rope.
    return config.replace(
        attention={"sliding_window": hf["sliding_window"],
                   "layer_types": _layer_types(hf.get("layer_types"), config.num_layers,
                                               architecture)},
        rope={"local_theta": _local_theta(config, sliding, hf, architecture)})


def _rope_settings(hf: dict, architecture: str) -> tuple[dict, dict]:
    """The full and the sliding layers' flat rope settings (`decoder_parts.rope_parameters`),
    as transformers' Olmo3Config resolves a config.json's."""
    by_type = hf.get("rope_parameters") or {}
    if not set(by_type) <= set(_LAYER_TYPES):
        raise ValueError(f"{architecture}: rope_parameters must be keyed by layer type "
                         f"{sorted(_LAYER_TYPES)}, got {sorted(by_type)}")
    default = {"rope_type": "default"}
    # A legacy rope_scaling updates the full layers' settings (a `type` in it leaves their
    # rope_type "default", as in transformers).
    full = {**(by_type.get("full_attention") or default), **(hf.get("rope_scaling") or {})}
    # Olmo3Config hands a top-level rope_theta to the full layers alone.
    top = hf.get("rope_theta")
    full.setdefault("rope_theta", _THETA if top is None else top)
    sliding = {"rope_theta": _THETA, **(by_type.get("sliding_attention") or default)}
    return tuple(decoder_parts.rope_parameters(
        {"rope_parameters": settings, "partial_rotary_factor": hf.get("partial_rotary_factor")})
        for settings in (full, sliding))


def _local_theta(config: DecoderConfig, sliding: dict, hf: dict, architecture: str
                 ) -> float | None:
    """rope.local_theta: None when the sliding layers rotate as `config` (the full layers)
    does, else their rope_theta, which tfx's sliding layers use unscaled."""
    theta = float(sliding["rope_theta"])
    scaling = decoder_parts.scaling_from_hf(sliding, hf, config.max_len, architecture)
    if (theta, scaling) == (config.rope.theta, config.rope.scaling):
        return None
    if scaling is not None:
        raise ValueError(f"{architecture}: rope_parameters['sliding_attention']={sliding} is not "
                         "supported (tfx's sliding layers rotate as the full layers do, or with a "
                         "rope_theta of their own, unscaled)")
    return theta


def _layer_types(kinds: list | None, num_layers: int, architecture: str) -> tuple[str, ...]:
    """config.json's layer_types (or Olmo3Config's default pattern) in tfx terms."""
    if kinds is None:
        kinds = ["sliding_attention" if (i + 1) % _FULL_EVERY else "full_attention"
                 for i in range(num_layers)]
    if len(kinds) != num_layers or not set(kinds) <= set(_LAYER_TYPES):
        raise ValueError(f"{architecture}: layer_types must be {num_layers} of "
                         f"{sorted(_LAYER_TYPES)}, got {kinds}")
    return tuple(_LAYER_TYPES[kind] for kind in kinds)


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> Olmo3Config fields; ValueError for what OLMo 3 cannot express."""
    decoder_parts.check_card(config, architecture, CARD)
    if config.attention.sliding_window is None:
        raise ValueError(f"{architecture} needs attention.sliding_window (transformers builds "
                         "the sliding layers' mask whatever the layer types)")
    # OLMo 2's fields (sizes, biases, the full layers' rope), then OLMo 3's.
    hf = olmo2.config_to_hf(config.replace(attention={"sliding_window": None, "layer_types": None},
                                           rope={"local_theta": None}), architecture)
    full, local = hf["rope_parameters"], config.rope.local_theta
    sliding = dict(full) if local is None else {"rope_type": "default", "rope_theta": local}
    hf.update(model_type="olmo3", sliding_window=config.attention.sliding_window,
              layer_types=[_HF_LAYER_TYPES[config.layer_type(i)]
                           for i in range(config.num_layers)],
              rope_parameters={"full_attention": full, "sliding_attention": sliding})
    return hf
