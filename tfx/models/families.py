"""Family cards: what each model family *is*, as data, each card a diff of its parent.

The public path of the cards and of what they are made of, which live in two modules:

- `tfx.models.family`: the mechanism, `Family` (a card: fixed fields, free fields, named
  sizes; `Family.but` writes one as a diff of its parent), `DEFAULTS`, `RUNTIME`, `flat` and
  `canonical`;
- `tfx.models.cards`: the cards, `LLAMA` ... `TRANSFORMER`, with their named sizes, `FAMILIES`
  (card by name), `SIZES` (card by named size) and `size_config`.

Both are re-exported here: `families.LLAMA`, `families.Family`, `families.size_config`. The
cards import neither jax nor flax.
"""

from __future__ import annotations

from tfx.models.cards import (
    BERT,
    DEEPSEEK_V3,
    FAMILIES,
    GEMMA2,
    GEMMA3,
    GEMMA4,
    GPT2,
    GPT_NEOX,
    GPT_OSS,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    MODERNBERT,
    OLMO2,
    OLMO3,
    PHI3,
    QWEN2,
    QWEN3,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_MOE,
    QWEN3_NEXT,
    SIZES,
    SMOLLM3,
    T5,
    TRANSFORMER,
    size_config,
)
from tfx.models.family import DEFAULTS, RUNTIME, Family, ModelConfig, canonical, flat

__all__ = ["BERT", "DEEPSEEK_V3", "DEFAULTS", "FAMILIES", "GEMMA2", "GEMMA3", "GEMMA4", "GPT2",
           "GPT_NEOX", "GPT_OSS", "LLAMA", "MISTRAL", "MIXTRAL", "MODERNBERT", "OLMO2", "OLMO3",
           "PHI3", "QWEN2", "QWEN3", "QWEN3_5", "QWEN3_5_MOE", "QWEN3_MOE", "QWEN3_NEXT",
           "RUNTIME", "SIZES", "SMOLLM3", "T5", "TRANSFORMER", "Family", "ModelConfig",
           "canonical", "flat", "size_config"]
