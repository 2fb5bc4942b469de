"""Normalisation layers (`NormConfig`): which norm, and where the layers apply it."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from tfx import names
from tfx.models.parts._checks import boolean, one_of

__all__ = ["NormConfig", "NormKind"]

# The names come from tfx.names (one source, jax-free), as tyro and the CLI read them.
NormKind = Literal[names.NORMS]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NormConfig:
    """Normalisation layers."""

    kind: NormKind = "layer"
    """LayerNorm ("layer") or RMSNorm ("rms")."""
    eps: float = 1e-5
    """Added to the variance (BERT 1e-12, GPT-2 1e-5, T5 1e-6)."""
    pre_norm: bool = True
    """x + f(norm(x)) (GPT-2, LLaMA, T5); False: norm(x + f(x)) (BERT, Vaswani et al.)."""
    inputs: bool = True
    """Pre-norm layers normalise each branch's input; False: they do not (OLMo 2, which
    normalises the outputs instead)."""
    outputs: bool = False
    """Pre-norm layers also normalise each branch's output before the residual sum,
    x + norm2(f(norm1(x))) (Gemma 2 and 3; OLMo 2 without norm1)."""
    bias: bool = True
    """LayerNorms have a bias (an RMSNorm never has one); False: a scale only (ModernBERT's
    norm_bias=False)."""
    first_attention: bool = True
    """The first layer normalises its attention's input like the others; False: it reads the
    embeddings as they are (ModernBERT, whose embeddings are normalised already,
    `embeddings.norm`). Pre-norm layers that normalise inputs only."""
    layer_scale: bool = False
    """Each layer's output is multiplied by a learned scalar, `layer_scale` [1] (Gemma 4's
    layer_scalar); False: not scaled."""

    def __post_init__(self):
        one_of("norm.kind", self.kind, get_args(NormKind))
        if not self.eps > 0:
            raise ValueError(f"norm.eps must be > 0, got {self.eps}")
        for name in ("pre_norm", "inputs", "outputs", "bias", "first_attention", "layer_scale"):
            boolean(f"norm.{name}", getattr(self, name))
        if not self.pre_norm and not (self.inputs and not self.outputs):
            raise ValueError("norm.inputs=False and norm.outputs=True are for pre-norm layers "
                             "(norm.pre_norm=True); post-norm layers normalise the residual sum")
        if not self.first_attention and not (self.pre_norm and self.inputs):
            raise ValueError("norm.first_attention=False drops the first layer's attention "
                             "input norm: it needs norm.pre_norm=True and norm.inputs=True")
