"""What each fine-tuning method can be told, defined once and importable without jax: the
`tfx.peft` methods subclass these settings (adding `attach`), and the command line's
fine-tuning configs (`tfx.train.finetuning`) subclass them too, so every option of a method is
an option of `tfx train --peft ...` with the same name, default and check.

Each `__post_init__` checks what can be checked without a model (ValueError/TypeError naming
the field); what needs the model (a rank above a layer's width, targets that match nothing)
is checked when the method attaches.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from tfx import names

__all__ = ["ADAPTER_PLACEMENTS", "LORA_INIT_STYLES", "PROMPT_INITS", "AdapterSettings",
           "LoRASettings", "PrefixSettings", "SoftPromptSettings", "check_targets"]

LORA_INIT_STYLES = ("peft", "seed", "seed_normal")
PROMPT_INITS = ("random", "vocab", "text")
ADAPTER_PLACEMENTS = ("houlsby", "pfeiffer")


def check_targets(targets) -> None:
    """Targets are a regex over module paths (it must compile) or a non-empty list of names
    (peft's target_modules); see `tfx.peft.core.path_matcher`."""
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as error:
            raise ValueError(f"targets {targets!r} is not a regular expression: {error}") from None
        return
    names = tuple(targets)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"targets must be a regex or a non-empty list of names, got {targets!r}")


def _int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRASettings:
    """LoRA (Hu et al. 2021): W + scale·a·b on the target weights."""

    rank: int = 8
    """Rank r of each update, 1 <= r <= min(d_in, d_out) of every target."""
    alpha: float = 16.0
    """The update is scaled by alpha / r (alpha / sqrt(r) with rslora)."""
    targets: str | tuple[str, ...] = ("query", "value")
    """Module names that get updates (query, key, value, out, up, gate, down, tokens, head), or
    one regex over module paths (peft's target_modules)."""
    init_style: Literal[LORA_INIT_STYLES] = "peft"
    """peft: a Kaiming-uniform ±1/sqrt(d_in), b zero (embeddings: a zero, b N(0, 1)); seed: b
    zero, a uniform ±init_scale/sqrt(r); seed_normal: b zero, a N(0, init_scale)."""
    init_scale: float = 0.05
    """The scale of a for init_style seed / seed_normal."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023)."""
    dropout: float = 0.0
    """Dropout on the input of the low-rank path (peft's lora_dropout), in [0, 1)."""

    def __post_init__(self):
        _int("rank", self.rank, 1)
        _positive("alpha", self.alpha)
        if self.init_style not in LORA_INIT_STYLES:
            raise ValueError(f"init_style must be one of {LORA_INIT_STYLES}, got "
                             f"{self.init_style!r}")
        _positive("init_scale", self.init_scale)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        check_targets(self.targets)

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)


@dataclasses.dataclass(frozen=True)
class SoftPromptSettings:
    """Prompt tuning (Lester et al. 2021): learned vectors before the input embeddings."""

    num_tokens: int
    """G, the number of prompt vectors (>= 1)."""
    init: Literal[PROMPT_INITS] = "random"
    """random: N(0, init_std); vocab: embeddings of random vocabulary tokens; text: embeddings
    of text_ids, repeated or cut to G."""
    text_ids: tuple[int, ...] | None = None
    """With init="text" (and only then), the token ids whose embeddings start the prompt."""
    init_std: float = 0.02
    """Standard deviation of init="random"."""

    def __post_init__(self):
        _int("num_tokens", self.num_tokens, 1)
        if self.init not in PROMPT_INITS:
            raise ValueError(f"init must be one of {PROMPT_INITS}, got {self.init!r}")
        if (self.init == "text") != (self.text_ids is not None):
            raise ValueError(f"text_ids must be given with init='text' and only then, got "
                             f"init={self.init!r}, text_ids={self.text_ids!r}")
        if self.text_ids is not None and (
                not isinstance(self.text_ids, tuple) or not self.text_ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                           for i in self.text_ids)):
            raise ValueError(f"text_ids must be a non-empty tuple of token ids (ints >= 0), got "
                             f"{self.text_ids!r}")
        _positive("init_std", self.init_std)


@dataclasses.dataclass(frozen=True)
class PrefixSettings:
    """Prefix tuning (Li & Liang 2021; peft's PREFIX_TUNING): learned keys and values before
    every targeted attention's own."""

    num_tokens: int
    """G, learned key/value positions per targeted layer (>= 1)."""
    targets: str | tuple[str, ...] = ("attention",)
    """Which attention modules get a prefix: a regex over "stack/layers/0/attention" paths, or
    names ("attention": every self-attention; "cross_attention": an encoder-decoder's)."""
    projection: int = 0
    """0 learns the keys and values directly; > 0 trains peft's reparameterisation MLP of this
    hidden width instead (one MLP for all layers: needs compute.scan_layers=False)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of the prefix (or of the MLP's embedding)."""

    def __post_init__(self):
        _int("num_tokens", self.num_tokens, 1)
        _int("projection", self.projection, 0)
        if isinstance(self.init_std, bool) or not isinstance(self.init_std, int | float) \
                or self.init_std < 0:
            raise ValueError(f"init_std must be a float >= 0, got {self.init_std!r}")
        if not isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(self.targets))
        check_targets(self.targets)


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
    """Bottleneck adapters (Houlsby et al. 2019, Pfeiffer et al. 2020) after sub-layers."""

    placement: Literal[ADAPTER_PLACEMENTS] = "houlsby"
    """houlsby: after attention and MLP; pfeiffer: after the MLP only."""
    size: int | None = None
    """Bottleneck width; None: d_model // reduction."""
    reduction: int = 16
    """d_model / size when size is None (16, as in Pfeiffer et al.)."""
    activation: Literal[names.ACTIVATIONS] = "relu"
    """The bottleneck's nonlinearity (tfx.ops.activations.ACTIVATIONS)."""
    init_std: float = 1e-2
    """Standard deviation of the down projection's (and, unless zero_up, the up's) init."""
    zero_up: bool = False
    """Start the up projection at zero: the adapter begins as the identity."""
    use_bias: bool = True
    """Biases in the adapter's projections."""
    cross_attention: bool = False
    """Also an adapter after every cross-attention (encoder-decoders)."""

    def __post_init__(self):
        if self.placement not in ADAPTER_PLACEMENTS:
            raise ValueError(f"placement must be one of {ADAPTER_PLACEMENTS}, got "
                             f"{self.placement!r}")
        if self.size is not None:
            _int("size", self.size, 1)
        _int("reduction", self.reduction, 1)
        if self.activation not in names.ACTIVATIONS:
            raise ValueError(f"activation must be one of {names.ACTIVATIONS}, got "
                             f"{self.activation!r}")
        _positive("init_std", self.init_std)
