"""What fine-tuning trains, one frozen dataclass per method: `FullTuning` (every weight) or one
of the `tfx.peft` methods, which train only the parameters they add, with the model frozen
(start it from a trained run with `train.init_from`). A method's config is its
`tfx.peft.settings` class (every option, defined once) plus what only the command line
chooses: a default where the method has none, and base changes such as LoRA's `quantize`.

`PeftConfig` is their union, the type of `Experiment.peft`; on the command line a method is a
subcommand (`peft:lora --peft.rank 8`, or `--peft lora`). Each config builds its `tfx.peft`
method object with `settings()`, which validates the values (and imports jax: only the
non-default methods do, when they are made).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar, Literal

import tyro

from tfx import names
from tfx.peft.settings import (
    PROMPT_INITS,
    AdapterSettings,
    LoRASettings,
    PrefixSettings,
    SoftPromptSettings,
)

__all__ = ["METHODS", "AdapterTuning", "FullTuning", "LoraTuning", "PeftConfig", "PrefixTuning",
           "PromptTuning", "peft_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullTuning:
    """Train every weight (no fine-tuning method)."""

    method: ClassVar[str] = "full"

    def settings(self) -> None:
        """No `tfx.peft` method."""
        return None

    def prepare_base(self, model) -> None:
        """Change the base model before the method attaches (nothing to do here)."""


class _Method:
    """A `tfx.peft` method's settings, its fields named as the method class's arguments:
    validated by building the method object."""

    method: ClassVar[str]
    peft_class: ClassVar[str]  # the tfx.peft class these settings build

    def __post_init__(self):
        self.settings()

    def prepare_base(self, model) -> None:
        """Change the base model before the method attaches (most methods change nothing)."""

    base_only: ClassVar[tuple[str, ...]] = ()  # fields that change the base, not the method

    def settings(self):
        """The `tfx.peft` method object of these settings."""
        from tfx import peft

        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in self.base_only}
        # A stored run (JSON) gives lists where the method takes tuples.
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        return getattr(peft, self.peft_class)(**fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraTuning(_Method, LoRASettings):
    """LoRA (Hu et al. 2021): low-rank updates of the target projections (`tfx.peft.LoRA`)."""

    method: ClassVar[str] = "lora"
    peft_class: ClassVar[str] = "LoRA"
    # Names only: a command line cannot tell one regex from a list of one name.
    targets: tuple[str, ...] = ("query", "value")
    """Module names that get updates (query, key, value, out, up, gate, down, tokens, head)."""
    quantize: Literal[names.QUANT_TYPES] | None = None
    """Quantize the frozen base's linear layers first (tfx.quant; nf4 is QLoRA)."""

    base_only: ClassVar[tuple[str, ...]] = ("quantize",)

    def prepare_base(self, model) -> None:
        """QLoRA: quantize the base (in place) before the factors attach."""
        if self.quantize is not None:
            from tfx.quant import quantize

            quantize(model, self.quantize)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptTuning(_Method, SoftPromptSettings):
    """Soft prompts (Lester et al. 2021): learned embeddings before the input
    (`tfx.peft.SoftPrompt`)."""

    method: ClassVar[str] = "prompt"
    peft_class: ClassVar[str] = "SoftPrompt"
    num_tokens: int = 16
    """Learned positions (16 unless told)."""
    init: Literal[PROMPT_INITS] = "vocab"
    """Start from embeddings of random vocabulary tokens (vocab), random vectors, or the
    embeddings of text_ids (text)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixTuning(_Method, PrefixSettings):
    """Prefix tuning (Li & Liang 2021): learned keys and values before every layer's
    (`tfx.peft.Prefix`)."""

    method: ClassVar[str] = "prefix"
    peft_class: ClassVar[str] = "Prefix"
    num_tokens: int = 16
    """Learned positions (16 unless told)."""
    # Names only, as LoraTuning's.
    targets: tuple[str, ...] = ("attention",)
    """Attention modules that get a prefix: attention (every self-attention), cross_attention."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterTuning(_Method, AdapterSettings):
    """Bottleneck adapters (Houlsby et al. 2019, Pfeiffer et al. 2020) after sub-layers
    (`tfx.peft.Adapters`)."""

    method: ClassVar[str] = "adapter"
    peft_class: ClassVar[str] = "Adapters"
    size: int | None = 16
    """Bottleneck width (16 unless told; None: d_model // reduction)."""


METHODS = {kind.method: kind for kind in
           (FullTuning, LoraTuning, PromptTuning, PrefixTuning, AdapterTuning)}


def peft_config(method: str, **settings) -> PeftConfig:
    """The config of fine-tuning `method` (a key of METHODS) with `settings` (its fields):
    `peft_config("lora", rank=4)` is `LoraTuning(rank=4)`."""
    if method not in METHODS:
        raise ValueError(f"peft.method must be one of {tuple(METHODS)}, got {method!r}")
    return METHODS[method](**settings)


# tyro: each method a subcommand named peft:<method>.
PeftConfig = (Annotated[FullTuning, tyro.conf.subcommand("full")]
              | Annotated[LoraTuning, tyro.conf.subcommand("lora")]
              | Annotated[PromptTuning, tyro.conf.subcommand("prompt")]
              | Annotated[PrefixTuning, tyro.conf.subcommand("prefix")]
              | Annotated[AdapterTuning, tyro.conf.subcommand("adapter")])
