"""SmolLM3 (`SmolLM3ForCausalLM`) checkpoints <-> tfx `Decoder`.

SmolLM3 is LLaMA (`tfx.hf.llama`: the same config fields and tensor names) whose layers listed
0 in config.json's `no_rope_layers` rotate nothing (NoPE: every fourth layer when the list is
absent, from `no_rope_layer_interval`) -> rope.nope_layers (its card:
`tfx.models.families.SMOLLM3`).

Refused (ValueError naming the field): what LLaMA refuses (a hidden_act other than "silu",
attention_bias and mlp_bias that differ, rope types tfx lacks), use_sliding_window with
"sliding_attention" layers, a no_rope_layers list not one per layer; on save, what the card
lacks.
"""

from __future__ import annotations

from tfx.hf.decoder_parts import (
    IGNORED,
    attention_bias,
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
from tfx.hf.llama import params_from_hf
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
           "params_from_hf", "params_to_hf", "steps", "tensor_names"]

ARCHITECTURES = ("SmolLM3ForCausalLM",)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
CARD = families.SMOLLM3  # what every SmolLM3 is: set on load, checked on save

# SmolLM3Config's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008,
                 num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                 head_dim=None, hidden_act="silu", max_position_embeddings=32768,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                 mlp_bias=False, use_sliding_window=False, no_rope_layers=None,
                 no_rope_layer_interval=4)


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """SmolLM3Config fields (config.json as a dict) -> DecoderConfig; dropout off."""
    hf = {**_DEFAULTS, **hf}
    check_silu(hf, architecture)
    if hf["use_sliding_window"] and "sliding_attention" in (hf.get("layer_types") or ()):
        raise ValueError(f"{architecture}: use_sliding_window with 'sliding_attention' layers "
                         "is not supported")
    if hf["attention_bias"] != hf["mlp_bias"]:
        raise ValueError(f"{architecture}: attention_bias={hf['attention_bias']} and "
                         f"mlp_bias={hf['mlp_bias']} differ; tfx has one use_bias for both")
    fields = {**common_fields(hf), **rope_fields(hf, architecture),
              "use_bias": bool(hf["attention_bias"]),
              "rope.nope_layers": _nope_layers(hf, architecture)}
    return from_card(CARD, fields)


def _nope_layers(hf: dict, architecture: str) -> tuple[int, ...]:
    """The layers that do not rotate: 0 in no_rope_layers (SmolLM3Config's default: every
    no_rope_layer_interval-th layer)."""
    layers, interval = hf["num_hidden_layers"], hf["no_rope_layer_interval"]
    rotates = hf["no_rope_layers"]
    if rotates is None:
        rotates = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(rotates) != layers or not set(rotates) <= {0, 1}:
        raise ValueError(f"{architecture}: no_rope_layers must be {layers} flags of 0 or 1, got "
                         f"{rotates}")
    return tuple(i for i, use in enumerate(rotates) if not use)


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> SmolLM3Config fields; ValueError for what SmolLM3 cannot express."""
    check_card(config, architecture, CARD)
    nope = set(config.rope.nope_layers)
    hf = common_fields_to_hf(config, architecture, "smollm3")
    if config.attention.head_dim is None:  # SmolLM3Config has no head_dim unless one is given
        del hf["head_dim"]
    return {**hf, "hidden_act": "silu",
            "rope_parameters": scaling_to_hf(config, architecture),
            "mlp_bias": config.use_bias,
            "attention_bias": attention_bias(config, architecture, mlp_bias=config.use_bias),
            "no_rope_layers": [int(i not in nope) for i in range(config.num_layers)],
            "use_sliding_window": False, "sliding_window": None,
            "layer_types": ["full_attention"] * config.num_layers}
