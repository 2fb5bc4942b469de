"""The presets (tfx.models.presets): named sizes of the family cards, each exactly the config
that was written out by hand before the cards built it, and `names` / `named_config`."""

from __future__ import annotations

import pytest

from tfx.models import families, presets
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

_BERT = dict(vocab_size=30522, max_len=512, position="learned", mlp=MlpConfig(activation="gelu"),
             norm=NormConfig(kind="layer", eps=1e-12, pre_norm=False), dropout=0.1)
_LLAMA = dict(position="rope", mlp=MlpConfig(activation="silu", gated=True), use_bias=False)
_CHAR = dict(vocab_size=256, d_model=256, num_layers=4, num_heads=4, d_ff=1024, max_len=256,
             **_LLAMA, norm=NormConfig(kind="rms", eps=1e-6),
             attention=AttentionConfig(num_kv_heads=2))
# The presets as they were written before the cards built them.
WRITTEN = {
    "bert-base": EncoderConfig(d_model=768, num_layers=12, num_heads=12, d_ff=3072, **_BERT),
    "minilm-l6": EncoderConfig(d_model=384, num_layers=6, num_heads=12, d_ff=1536, **_BERT),
    "gpt2-small": DecoderConfig(vocab_size=50257, d_model=768, num_layers=12, num_heads=12,
                                d_ff=3072, max_len=1024, mlp=MlpConfig(activation="gelu_tanh"),
                                dropout=0.1),
    "llama-tiny": DecoderConfig(vocab_size=32000, d_model=256, num_layers=4, num_heads=8,
                                d_ff=688, max_len=2048, **_LLAMA,
                                norm=NormConfig(kind="rms", eps=1e-5),
                                attention=AttentionConfig(num_kv_heads=2),
                                embeddings=EmbeddingsConfig(tie=False)),
    "char-gpt": DecoderConfig(**_CHAR),
    "char-moe": DecoderConfig(**_CHAR, moe=MoeConfig(num_experts=8, experts_per_token=2,
                                                     d_ff=512)),
    "t5-small": EncoderDecoderConfig(
        vocab_size=32128, d_model=512, num_layers=6, num_heads=8, d_ff=2048, position="t5",
        norm=NormConfig(kind="rms", eps=1e-6), mlp=MlpConfig(activation="relu"),
        use_bias=False, attention=AttentionConfig(scale=1.0), scale_tied_head=True, dropout=0.1),
    "transformer-base": EncoderDecoderConfig(
        vocab_size=37000, d_model=512, num_layers=6, num_heads=8, d_ff=2048,
        position="sinusoidal", norm=NormConfig(kind="layer", eps=1e-6, pre_norm=False),
        mlp=MlpConfig(activation="relu"), dropout=0.1, embeddings=EmbeddingsConfig(scale=True)),
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_preset_is_the_config_once_written_out(name):
    assert presets.PRESETS[name] == WRITTEN[name]
    assert families.SIZES[name].mismatches(presets.PRESETS[name]) == {}


def test_names_lists_the_presets_then_the_other_sizes():
    names = presets.names()
    assert names[:len(WRITTEN)] == list(WRITTEN)
    assert sorted(names) == sorted(families.SIZES) and len(set(names)) == len(names)
    assert all(presets.named_config(name) == families.size_config(name) for name in names)
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        presets.named_config("gpt5")
