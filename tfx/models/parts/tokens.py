"""Tokens in and out: the token embedding table (`EmbeddingsConfig`) and an encoder's special
token ids (`SpecialTokens`)."""

from __future__ import annotations

import dataclasses

from tfx.models.parts._checks import boolean, positive_int

__all__ = ["EmbeddingsConfig", "SpecialTokens"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingsConfig:
    """The token embedding table."""

    tie: bool = True
    """Share the table with the output head."""
    scale: bool = False
    """Multiply token embeddings by sqrt(d_model), as Vaswani et al. 2017 do: with small
    embeddings (std 0.02), sinusoidal positions of magnitude 1 would drown the token."""
    pad_id: int | None = None
    """The vocabulary's padding token, if it has one (T5: 0; Hugging Face's `pad_token_id`):
    `tfx.generate` and `beam_search` fill finished rows with it. The table treats it like any
    other id."""
    norm: bool = False
    """Pre-norm models normalise the embeddings too (ModernBERT), with the model's norm;
    post-norm models (BERT) always do."""
    per_layer_width: int | None = None
    """Per-layer embeddings (Gemma 4's PLE, `tfx.nn.per_layer_embeddings`; decoders): each
    layer gates an input of this width into its residual stream after its MLP, mixed from a
    table [per_layer_vocab_size, num_layers * width] and a projection of the main embedding
    (hidden_size_per_layer_input); None: no per-layer inputs."""
    per_layer_vocab_size: int | None = None
    """Rows of the per-layer table (vocab_size_per_layer_input); None: vocab_size."""

    def __post_init__(self):
        boolean("embeddings.tie", self.tie)
        boolean("embeddings.scale", self.scale)
        boolean("embeddings.norm", self.norm)
        for name in ("per_layer_width", "per_layer_vocab_size"):
            if getattr(self, name) is not None:
                positive_int(f"embeddings.{name}", getattr(self, name))
        if self.per_layer_vocab_size is not None and self.per_layer_width is None:
            raise ValueError("embeddings.per_layer_vocab_size needs embeddings.per_layer_width "
                             "(the per-layer embeddings it sizes)")
        if self.pad_id is not None:
            positive_int("embeddings.pad_id", self.pad_id, minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecialTokens:
    """An encoder's special token ids (BERT's vocabulary by default), for masked-LM training
    and for building inputs."""

    pad_id: int = 0
    """[PAD]."""
    cls_id: int = 101
    """[CLS], the first token; the pooler reads it."""
    sep_id: int = 102
    """[SEP], after each segment."""
    mask_id: int = 103
    """[MASK], what masked-LM training hides tokens behind."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            positive_int(f"special_tokens.{f.name}", getattr(self, f.name), minimum=0)
