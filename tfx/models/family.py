"""What a model family is, as data: a `Family` card, written as a diff of its parent card.

A `Family` holds a family's fixed choices as model config field values by dotted name
(`"norm.kind": "rms"`, `"attention.qk_norm": "per_head"`), the names of the fields that vary
from model to model of the family (`free`: sizes, and choices a checkpoint's config states), and
named sizes (`sizes`: "qwen3-0.6b" -> its free fields, from the public config.json; "char-gpt"
-> those of a model of tfx's own). Its `kind` is the config class its models have: a decoder
(`DecoderConfig`, the default), an encoder (BERT) or an encoder-decoder (T5). Every field a card
neither fixes nor frees has its kind's default (`DEFAULTS`): a new layer part, added with an
"off" default, is thus refused by every family that does not name it, with no table to edit.

    LLAMA = Family(name="llama", fixed={...}, free={...})
    OLMO2 = LLAMA.but(name="olmo2", norm={"inputs": False, "outputs": True},
                      attention={"qk_norm": "across_heads"})

The cards themselves are in `tfx.models.cards`. `tfx.hf` converters read a card for what it
fixes and compare a model's config with it before a save (`Family.mismatches`, with equal
meanings made equal by `canonical`). This module imports neither jax nor flax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from tfx.models.config import (
    OPTIONAL_SUBCONFIGS,
    SUBCONFIGS,
    DecoderConfig,
    EncoderConfig,
    EncoderDecoderConfig,
    nested,
)

__all__ = ["DEFAULTS", "RUNTIME", "Family", "ModelConfig", "canonical", "flat"]

# The config classes that a card's models have (its `kind`).
ModelConfig = DecoderConfig | EncoderConfig | EncoderDecoderConfig

# Fields that say how a model runs, not what it computes: free in every family.
RUNTIME = frozenset({"compute", "attention.implementation", "moe.dispatch", "moe.jitter",
                     "dropout"})
# The sizes of every model (each family frees more: head counts, widths of its parts, ...).
_SIZES = frozenset({"vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len",
                    "embeddings.pad_id"})


def _defaults(cls: type) -> dict:
    """Default value of every field of model config class `cls`, by dotted name; the fields of
    a sub-config by its class's defaults (an optional one's own entry is None: absent)."""
    out = {}
    for field in dataclasses.fields(cls):
        if field.name in SUBCONFIGS:
            kind = SUBCONFIGS[field.name]
            for sub in dataclasses.fields(kind):
                out[f"{field.name}.{sub.name}"] = sub.default
            if field.default is None:
                out[field.name] = None
        elif field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        else:
            out[field.name] = None  # a size: every card frees it
    return out


# Model config class -> the default of each of its fields, by dotted name.
DEFAULTS = MappingProxyType({cls: MappingProxyType(_defaults(cls))
                             for cls in (DecoderConfig, EncoderConfig, EncoderDecoderConfig)})


def flat(changes: Mapping, kind: type = DecoderConfig) -> dict:
    """Field values of model config class `kind` given as config keywords (a sub-config as a
    dict of its fields, or None) -> the same by dotted name: {"norm": {"kind": "rms"}} ->
    {"norm.kind": "rms"}."""
    out = {}
    for name, value in changes.items():
        if name in SUBCONFIGS and isinstance(value, Mapping):
            out.update({f"{name}.{field}": v for field, v in value.items()})
        else:
            out[name] = value
    unknown = sorted(name for name in out if name not in DEFAULTS[kind])
    if unknown:
        raise ValueError(f"{unknown} are not fields of {kind.__name__}")
    return out


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: the field values every model of it has (`fixed`: config keywords or
    dotted names, kept by dotted name), the fields its models choose (`free`: a name or a
    sub-config's name for all its fields), and its named sizes (`sizes`: name -> the free
    fields, as config keywords or dotted names). `parent` names the card this one is a `but`
    of; `kind` is the config class of its models."""

    name: str
    fixed: Mapping = dataclasses.field(default_factory=dict)
    free: frozenset = frozenset()
    sizes: Mapping = dataclasses.field(default_factory=dict)
    parent: str | None = None
    kind: type = DecoderConfig

    def __post_init__(self):
        fixed = flat(self.fixed, self.kind)
        # A part the card removes (moe=None) takes no fields: drop what a parent set in it.
        absent = {name for name, value in fixed.items() if name in SUBCONFIGS and value is None}
        fixed = {k: v for k, v in fixed.items() if "." not in k or k.split(".")[0] not in absent}
        object.__setattr__(self, "fixed", MappingProxyType(fixed))  # frozen: set once, here
        object.__setattr__(self, "free", frozenset(self.free) - set(fixed))
        sizes = {name: MappingProxyType(flat(size, self.kind))
                 for name, size in self.sizes.items()}
        object.__setattr__(self, "sizes", MappingProxyType(sizes))
        for size, fields in sizes.items():
            taken = sorted(name for name in fields if not self.is_free(name))
            if taken:
                raise ValueError(f"family {self.name!r}: size {size!r} sets {taken}, which the "
                                 "family fixes or does not have")

    @property
    def defaults(self) -> Mapping:
        """The default of each field of the family's config class, by dotted name."""
        return DEFAULTS[self.kind]

    def but(self, *, name: str, free=(), sizes: Mapping | None = None, **changes) -> Family:
        """This card with `changes` fixed (config keywords: a sub-config as a dict of the
        fields to change, or None to remove it), the fields `free` freed, its own `sizes`
        (none of the parent's): everything else as the parent has it."""
        changes = flat(changes, self.kind)
        # A part given fields is present: drop a parent's `part: None`.
        parts = {name.partition(".")[0] for name in changes if "." in name}
        fixed = {k: v for k, v in self.fixed.items() if k not in set(free) and k not in parts}
        return Family(name=name, fixed={**fixed, **changes}, free=self.free | set(free),
                      sizes=sizes or {}, parent=self.name, kind=self.kind)

    def is_free(self, name: str) -> bool:
        """Whether models of the family choose field `name` (dotted) for themselves."""
        part = name.partition(".")[0]
        return name in self.free or part in self.free or name in RUNTIME or part in RUNTIME

    def has(self, part: str) -> bool:
        """Whether the family's models have optional sub-config `part` ("moe", "latent",
        "rope", "t5")."""
        # The settings of a position kind ("rope", "t5") come with it.
        if self.fixed.get("position") == part:
            return True
        named = set(self.fixed) | set(self.free)
        return any(name.startswith(part + ".") for name in named) or part in self.free

    def expected(self, name: str):
        """The value field `name` (dotted) has in every model of the family."""
        return self.fixed[name] if name in self.fixed else self.defaults[name]

    def config(self, size: str | Mapping | None = None, **overrides) -> ModelConfig:
        """The config (of class `kind`) of a model of the family: its fixed fields, the free
        ones of `size` (a name in `sizes`, or a dict by dotted name), then `overrides` (config
        keywords, as `TransformerConfig.replace` takes them)."""
        fields = dict(self.sizes[size] if isinstance(size, str) else flat(size or {}, self.kind))
        taken = sorted(name for name in fields if not self.is_free(name))
        if taken:  # a converter reads sizes only: the card says what the family is
            raise ValueError(f"family {self.name!r} fixes {taken}: a size cannot set them")
        config = self.kind(**nested({**self.fixed, **fields}))
        return config.replace(**overrides) if overrides else config

    def mismatches(self, config) -> dict[str, tuple]:
        """Field (dotted) -> (config's value, the family's) for each field of `config` that no
        model of the family has; {} for a model of the family. A config of another class than
        `kind` mismatches as {"config": (its class's name, kind's)}. An optional part (`moe`,
        ...) is compared by presence first: (None, "present") when the family has it and
        `config` not, ("present", None) the other way round. Equal meanings are equal
        (`canonical`)."""
        if type(config) is not self.kind:
            return {"config": (type(config).__name__, self.kind.__name__)}
        out = {}
        optional = [name for name in OPTIONAL_SUBCONFIGS if name in self.defaults]
        for part in optional:
            present = getattr(config, part) is not None
            if present != self.has(part):
                out[part] = ("present", None) if present else (None, "present")
        family = canonical({**self.defaults, **self.fixed})
        for name, value in canonical(config).items():
            if name in optional or name.partition(".")[0] in out or self.is_free(name):
                continue
            if value != family[name]:
                out[name] = (value, family[name])
        return out


def canonical(config: ModelConfig | Mapping) -> dict:
    """The fields of `config` (a model config, or field values by dotted name) by dotted name,
    each spelled as its default where it means the same: a bias flag equal to use_bias, a
    key/value head count equal to num_heads, a head width of d_model // num_heads, as many
    decoder layers as encoder layers. Two configs of one model have equal canonical fields."""
    if isinstance(config, Mapping):
        values = dict(config)
    else:
        values = {}
        for name in DEFAULTS[type(config)]:
            part, dot, field = name.partition(".")
            holder = getattr(config, part, None)
            if not dot:
                values[name] = holder if part not in SUBCONFIGS or holder is None else "present"
            elif holder is not None:
                values[name] = getattr(holder, field)
    return {name: _canonical_value(name, value, values) for name, value in values.items()}


def _canonical_value(name: str, value, values: Mapping):
    """None for a value that means what None means in the config `values` (dotted)."""
    if name in ("attention.qkv_bias", "attention.out_bias") and value == values.get("use_bias"):
        return None
    if name == "attention.num_kv_heads" and value is not None and value == values.get("num_heads"):
        return None
    if name == "attention.head_dim" and value is not None and values.get("num_heads") and \
            values.get("d_model") == value * values["num_heads"]:
        return None
    if name == "num_decoder_layers" and value == values.get("num_layers"):
        return None
    return value
