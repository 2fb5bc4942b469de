"""LLaMA (`LlamaForCausalLM`) and Mistral (`MistralForCausalLM`) checkpoints <-> tfx `Decoder`.

What the two families are lives in their cards, `tfx.models.families.LLAMA` and `MISTRAL` (a
pre-norm decoder with RMSNorm, a SwiGLU MLP, grouped-query attention and rotary positions;
Mistral without biases, with a sliding attention window); this module reads their sizes from
config.json and maps the tensors, with the helpers that the other LLaMA-style converters share
(`tfx.hf.decoder_parts`: RoPE settings and scalings, tensor names, the export check).
"""

from __future__ import annotations

import numpy as np

from tfx.hf import plan
from tfx.hf.decoder_parts import (
    IGNORED,
    attention_bias,
    biases,
    check_card,
    check_silu,
    common_fields,
    common_fields_to_hf,
    from_card,
    params_to_hf,
    rope_fields,
    scaling_to_hf,
    steps,
    tensor_names,
)
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "CARDS", "IGNORED", "OPTIONAL_PARAMS", "biases", "config_from_hf",
           "config_to_hf", "params_from_hf", "params_to_hf", "steps", "tensor_names"]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
CARDS = {"LlamaForCausalLM": families.LLAMA, "MistralForCausalLM": families.MISTRAL}

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
# The config classes' defaults, for config.json files that leave a field out.
_COMMON = dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               head_dim=None, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False)
_DEFAULTS = {
    "LlamaForCausalLM": dict(_COMMON, intermediate_size=11008, num_key_value_heads=None,
                             max_position_embeddings=2048, attention_bias=False, mlp_bias=False),
    "MistralForCausalLM": dict(_COMMON, intermediate_size=14336, num_key_value_heads=8,
                               max_position_embeddings=4096 * 32, sliding_window=4096),
}


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """LlamaConfig / MistralConfig fields (config.json as a dict) -> DecoderConfig; dropout off."""
    hf = {**_DEFAULTS[architecture], **hf}
    check_silu(hf, architecture)
    fields = {**common_fields(hf), **rope_fields(hf, architecture)}
    if architecture == "MistralForCausalLM":
        fields["attention.sliding_window"] = hf["sliding_window"]
    else:
        if hf["attention_bias"] != hf["mlp_bias"]:
            raise ValueError(f"{architecture}: attention_bias={hf['attention_bias']} and "
                             f"mlp_bias={hf['mlp_bias']} differ; tfx has one use_bias for both")
        fields["use_bias"] = bool(hf["attention_bias"])
    return from_card(CARDS[architecture], fields)


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> LlamaConfig / MistralConfig fields; ValueError for what they cannot
    express."""
    if architecture == "LlamaForCausalLM" and isinstance(config, DecoderConfig) and \
            config.attention.sliding_window is not None:
        raise ValueError(f"{architecture} cannot express attention.sliding_window="
                         f"{config.attention.sliding_window} (save as MistralForCausalLM)")
    check_card(config, architecture, CARDS[architecture])
    hf = {**common_fields_to_hf(config, architecture, _MODEL_TYPES[architecture]),
          "hidden_act": "silu", "rope_parameters": scaling_to_hf(config, architecture)}
    if architecture == "MistralForCausalLM":
        hf["sliding_window"] = config.attention.sliding_window
    else:
        hf["mlp_bias"] = config.use_bias
        hf["attention_bias"] = attention_bias(config, architecture, mlp_bias=config.use_bias)
    return hf


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """LlamaForCausalLM / MistralForCausalLM tensors -> tfx parameters by state path (every
    tensor accounted for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)
