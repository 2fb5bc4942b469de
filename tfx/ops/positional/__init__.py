"""Positional encodings as pure functions.

Absolute: `sinusoidal` (learned absolute embeddings are a module in `tfx.nn`). Rotary:
`apply_rope` with linear / NTK / dynamic NTK / YaRN / llama3 /
proportional scaling. Relative biases:
`t5_relative_bias` (T5 buckets), `alibi_bias` (ALiBi), and Transformer-XL's relative scores.
NoPE ("no positional encoding") is simply none of these.
"""

from tfx.ops.positional.absolute import sinusoidal
from tfx.ops.positional.alibi import alibi_bias, alibi_slopes
from tfx.ops.positional.rope import (
    SCALINGS,
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    NTKScaling,
    ProportionalScaling,
    RopeScaling,
    YaRNScaling,
    apply_rope,
    rope_frequencies,
)
from tfx.ops.positional.t5 import relative_positions, t5_relative_bias, t5_relative_position_bucket
from tfx.ops.positional.transformer_xl import (
    transformer_xl_position_embeddings,
    transformer_xl_position_scores,
    transformer_xl_scores,
)

__all__ = [
    "SCALINGS",
    "DynamicNTKScaling",
    "LinearScaling",
    "Llama3Scaling",
    "NTKScaling",
    "ProportionalScaling",
    "RopeScaling",
    "YaRNScaling",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "relative_positions",
    "rope_frequencies",
    "sinusoidal",
    "t5_relative_bias",
    "t5_relative_position_bucket",
    "transformer_xl_position_embeddings",
    "transformer_xl_position_scores",
    "transformer_xl_scores",
]
