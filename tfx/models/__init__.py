"""Models built from configs: Encoder (BERT), Decoder (GPT-2 / LLaMA / Mistral) and
EncoderDecoder (T5 / original Transformer), with named presets; `checked` compiles a function
with the models' value checks on (see tfx.models.checks)."""

from tfx.models.checks import checked
from tfx.models.config import (
    AttentionConfig,
    ComputeConfig,
    DecoderConfig,
    EmbeddingsConfig,
    EncoderConfig,
    EncoderDecoderConfig,
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
from tfx.models.moe_losses import aux_loss, moe_losses
from tfx.models.presets import PRESETS, create

__all__ = ["PRESETS", "AttentionConfig", "ComputeConfig", "Decoder", "DecoderConfig",
           "EmbeddingsConfig", "Encoder", "EncoderConfig", "EncoderDecoder", "EncoderDecoderConfig",
           "MlpConfig", "MoeConfig", "NormConfig", "RopeConfig", "SpecialTokens", "T5BiasConfig",
           "TransformerConfig", "aux_loss", "checked", "create", "moe_losses",
           "token_types_from_separators"]
