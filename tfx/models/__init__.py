"""Models built from configs: Encoder (BERT), Decoder (GPT-2 / LLaMA / Mistral) and
EncoderDecoder (T5 / original Transformer), with named presets and family cards (`Family`:
what LLaMA, Qwen, Gemma, OLMo 2, ... are, with their named sizes; see tfx.models.families);
`checked` compiles a function with the models' value checks on (see tfx.models.checks); `pure`
turns a model into a pure function for jax.jit / jax.grad (see tfx.models.functional).

Names load on first use: the configs and presets import without jax (the command line reads
them), the models with it."""

from typing import TYPE_CHECKING

from tfx._lazy import lazy_exports

if TYPE_CHECKING:
    from tfx.models.checks import checked
    from tfx.models.config import (
        AttentionConfig,
        ComputeConfig,
        DecoderConfig,
        EmbeddingsConfig,
        EncoderConfig,
        EncoderDecoderConfig,
        LatentConfig,
        MlpConfig,
        MoeConfig,
        NormConfig,
        RopeConfig,
        SpecialTokens,
        T5BiasConfig,
        TransformerConfig,
    )
    from tfx.models.decoder import Decoder
    from tfx.models.encoder import Encoder, token_types_from_separators
    from tfx.models.encoder_decoder import EncoderDecoder
    from tfx.models.expert_losses import aux_loss, moe_losses
    from tfx.models.families import FAMILIES, SIZES, Family
    from tfx.models.functional import pure
    from tfx.models.presets import PRESETS, create

_CONFIGS = ("AttentionConfig", "ComputeConfig", "DecoderConfig", "EmbeddingsConfig",
            "EncoderConfig", "EncoderDecoderConfig", "LatentConfig", "MlpConfig", "MoeConfig",
            "NormConfig", "RopeConfig", "SpecialTokens", "T5BiasConfig", "TransformerConfig")

__all__ = ["FAMILIES", "PRESETS", "SIZES", "AttentionConfig", "ComputeConfig", "Decoder",
           "DecoderConfig", "EmbeddingsConfig", "Encoder", "EncoderConfig", "EncoderDecoder",
           "EncoderDecoderConfig", "Family", "LatentConfig", "MlpConfig", "MoeConfig",
           "NormConfig", "RopeConfig", "SpecialTokens", "T5BiasConfig", "TransformerConfig",
           "aux_loss", "checked", "create", "moe_losses", "pure", "token_types_from_separators"]

__getattr__, __dir__ = lazy_exports(__name__, {
    **{name: f"tfx.models.config:{name}" for name in _CONFIGS},
    "checked": "tfx.models.checks:checked", "Decoder": "tfx.models.decoder:Decoder",
    "Encoder": "tfx.models.encoder:Encoder",
    "token_types_from_separators": "tfx.models.encoder:token_types_from_separators",
    "EncoderDecoder": "tfx.models.encoder_decoder:EncoderDecoder",
    "aux_loss": "tfx.models.expert_losses:aux_loss",
    "moe_losses": "tfx.models.expert_losses:moe_losses",
    **{name: f"tfx.models.families:{name}" for name in ("FAMILIES", "SIZES", "Family")},
    "PRESETS": "tfx.models.presets:PRESETS", "create": "tfx.models.presets:create",
    "pure": "tfx.models.functional:pure"})
