"""Model configurations: one frozen, validated dataclass per family, with named presets.

Fields shared by every family live in `TransformerConfig`; `EncoderConfig` (BERT),
`DecoderConfig` (GPT-2 / LLaMA / Mistral) and `EncoderDecoderConfig` (T5, original Transformer)
add their own. Sizes and kinds are top-level fields; everything else is nested by concern in
the sub-configs of `tfx.models.parts` (`rope`, `t5`, `attention`, `mlp`, `norm`, `moe`,
`embeddings`, `compute`), absent (None) when unused where they are optional. Every field is
validated in `__post_init__` with a message naming it by its dotted path (`moe.num_experts`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, get_args

from tfx.models.parts import (
    COMPUTE_DTYPES,
    AttentionConfig,
    ComputeConfig,
    EmbeddingsConfig,
    LatentConfig,
    LinearAttentionConfig,
    MlpConfig,
    MoeConfig,
    NormConfig,
    RopeConfig,
    SpecialTokens,
    T5BiasConfig,
    positive_int,
)

if TYPE_CHECKING:
    import jax.numpy as jnp

__all__ = ["COMPUTE_DTYPES", "OPTIONAL_SUBCONFIGS", "POSITIONS", "SUBCONFIGS",
           "AttentionConfig", "ComputeConfig", "DecoderConfig", "EmbeddingsConfig",
           "EncoderConfig", "EncoderDecoderConfig", "LatentConfig", "LinearAttentionConfig",
           "MlpConfig", "MoeConfig",
           "NormConfig", "RopeConfig", "SpecialTokens", "T5BiasConfig", "TransformerConfig",
           "compute_dtype", "field_value", "nested"]

# How a model knows where tokens are: added to the embeddings ("learned", "sinusoidal"), rotated
# into queries and keys ("rope"), added to the scores ("alibi", "t5", and Transformer-XL's
# relative attention "xl", decoders only), or not at all ("none", NoPE).
Position = Literal["learned", "sinusoidal", "rope", "alibi", "t5", "xl", "none"]
POSITIONS = get_args(Position)

# The sub-config fields of the model configs and their classes (see `TransformerConfig.replace`).
SUBCONFIGS = {"rope": RopeConfig, "t5": T5BiasConfig, "attention": AttentionConfig,
              "mlp": MlpConfig, "norm": NormConfig, "moe": MoeConfig,
              "embeddings": EmbeddingsConfig, "compute": ComputeConfig,
              "special_tokens": SpecialTokens, "latent": LatentConfig,
              "linear": LinearAttentionConfig}
# The sub-configs that may be None (absent: not used by the model).
OPTIONAL_SUBCONFIGS = ("rope", "t5", "moe", "latent", "linear")
# Sub-configs that exist only for one position kind: filled with their defaults when that kind
# is chosen without them, refused with any other.
_POSITION_PARTS = {"rope": "rope", "t5": "t5"}


def compute_dtype(config_dtype: str | None, platform: str) -> jnp.dtype | None:
    """The compute dtype of a model whose config says `dtype=config_dtype`, on `platform`.

    An explicit config value wins everywhere ("float32" forces float32 on accelerators too);
    None means the platform's default (`tfx.ops.backends.default_compute_dtype`: bfloat16 on
    GPU and TPU; None on CPU and other platforms, i.e. float32 with float32 parameters).
    Softmax statistics and router logits are float32 whatever this returns (tfx.ops computes
    them so).

    Args:
      config_dtype: None or one of "float32", "bfloat16", "float16".
      platform: a platform name as `jax.default_backend()` returns it ("cpu", "gpu", "tpu").
    """
    import jax.numpy as jnp  # here, not at the top: configs import without jax

    from tfx.ops.backends import default_compute_dtype

    if config_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {config_dtype!r}")
    dtype = config_dtype or default_compute_dtype(platform)
    return None if dtype is None else jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Fields shared by every family. Widths: d_model = hidden size, d_ff = MLP hidden size.

    `position` says how the model knows where tokens are (POSITIONS); `rope` and `t5` hold the
    settings of the rotary and T5 kinds and are None for the others. `moe` None is a dense
    model. `use_bias`: biases in the attention and MLP projections.

    A sub-config field takes its sub-config or a dict of its fields (the others keep their
    defaults): `DecoderConfig(..., norm={"kind": "rms", "eps": 1e-6})`.
    """

    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    d_model: int
    """Width of the residual stream (hidden size)."""
    num_layers: int
    """Transformer layers (an encoder-decoder's encoder layers)."""
    num_heads: int
    """Attention (query) heads."""
    d_ff: int
    """Hidden width of the MLP."""
    max_len: int = 2048
    """Longest sequence: the table size of learned positions; otherwise informative."""
    position: Position = "learned"
    """How the model knows where tokens are (POSITIONS)."""
    rope: RopeConfig | None = None
    """Rotary settings; None unless position="rope" (which defaults it)."""
    t5: T5BiasConfig | None = None
    """T5 bias settings; None unless position="t5" (which defaults it)."""
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    """Heads, kernel, windows and sparse patterns."""
    mlp: MlpConfig = dataclasses.field(default_factory=MlpConfig)
    """The feed-forward block."""
    norm: NormConfig = dataclasses.field(default_factory=NormConfig)
    """Normalisation layers."""
    moe: MoeConfig | None = None
    """A mixture of experts in place of MLPs; None for a dense model."""
    embeddings: EmbeddingsConfig = dataclasses.field(default_factory=EmbeddingsConfig)
    """The token embedding table."""
    compute: ComputeConfig = dataclasses.field(default_factory=ComputeConfig)
    """Dtypes, rematerialisation, scanned layers."""
    use_bias: bool = True
    """Biases in the attention and MLP projections."""
    dropout: float = 0.0
    """Dropout rate, applied while the model is in training mode."""

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len"):
            positive_int(name, getattr(self, name))
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {self.position!r}")
        for name, kind in SUBCONFIGS.items():
            if hasattr(self, name):
                _check_part(self, name, kind)
        pad = self.embeddings.pad_id
        if pad is not None and pad >= self.vocab_size:
            raise ValueError(f"embeddings.pad_id must be < vocab_size ({self.vocab_size}), "
                             f"got {pad}")
        for name in ("num_kv_heads", "full_kv_heads"):
            heads = getattr(self.attention, name) or self.kv_heads
            if self.num_heads % heads:
                raise ValueError(f"attention.{name} ({heads}) must divide num_heads "
                                 f"({self.num_heads})")
        if self.attention.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads "
                             f"({self.num_heads}) unless attention.head_dim is given")
        if not isinstance(self.use_bias, bool):
            raise TypeError(f"use_bias must be a bool, got {type(self.use_bias).__name__}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        self._check_layers()

    def _check_layers(self):
        """Per-layer kinds: as many layer types as layers; scanned layers all alike."""
        types = self.attention.layer_types
        if types is not None and len(types) != self.num_layers:
            raise ValueError(f"attention.layer_types has {len(types)} entries, one per layer: "
                             f"num_layers is {self.num_layers}")
        a = self.attention
        if not hasattr(self, "linear") and (
                self.embeddings.per_layer_width or a.shared_kv_layers or a.full_head_dim
                or a.full_kv_heads or a.full_values_are_keys):
            raise ValueError(f"embeddings.per_layer_width, attention.shared_kv_layers and "
                             f"attention.full_* are for causal decoders (DecoderConfig), not "
                             f"{type(self).__name__}")
        if types is not None and "linear" in types and not hasattr(self, "linear"):
            raise ValueError(f"attention.layer_types 'linear' (Gated DeltaNet) is for causal "
                             f"decoders (DecoderConfig), not {type(self).__name__}")
        nope = () if self.rope is None else self.rope.nope_layers
        if any(i >= self.num_layers for i in nope):
            raise ValueError(f"rope.nope_layers must be layer indices < num_layers "
                             f"({self.num_layers}), got {nope}")
        if not self.compute.scan_layers:
            return
        if self.embeddings.per_layer_width is not None:
            raise ValueError("compute.scan_layers is not supported with per-layer embeddings "
                             "(embeddings.per_layer_width): each layer reads its own slice")
        if nope:
            raise ValueError("compute.scan_layers runs one kind of layer: rope.nope_layers "
                             f"{nope} leaves some without positions")
        if self.moe is not None and (self.moe.every != 1 or self.moe.first_dense):
            raise ValueError(f"compute.scan_layers runs one kind of layer: with experts it needs "
                             f"moe.every=1 and moe.first_dense=0, got {self.moe.every} and "
                             f"{self.moe.first_dense}")
        if types is not None and len(set(types)) > 1:
            raise ValueError("compute.scan_layers runs one kind of layer: attention.layer_types "
                             f"mixes {sorted(set(types))}")
        if not self.norm.first_attention and self.num_layers > 1:
            raise ValueError("compute.scan_layers runs one kind of layer: "
                             "norm.first_attention=False makes the first one differ")

    def has_positions(self, index: int) -> bool:
        """Whether layer `index` (0-based) encodes positions in its self-attention: all but
        the rope.nope_layers."""
        return self.rope is None or index not in self.rope.nope_layers

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) has a mixture of experts in place of its MLP."""
        return (self.moe is not None and index >= self.moe.first_dense
                and (index + 1) % self.moe.every == 0)

    def layer_type(self, index: int) -> str:
        """How layer `index` (0-based) mixes tokens: "sliding" (attention to the last
        attention.sliding_window tokens), "full" or "linear" (Gated DeltaNet; see
        AttentionConfig.layer_types)."""
        types = self.attention.layer_types
        if types is not None:
            return types[index]
        return "full" if self.attention.sliding_window is None else "sliding"

    def layer_heads(self, layer_type: str) -> tuple[int, int]:
        """(key/value heads, head width) of the attention of a layer of `layer_type`: the
        "full" layers' own (attention.full_kv_heads, full_head_dim) where set."""
        kv_heads = self.kv_heads
        head_dim = self.attention.head_dim or self.d_model // self.num_heads
        if layer_type == "full":
            kv_heads = self.attention.full_kv_heads or kv_heads
            head_dim = self.attention.full_head_dim or head_dim
        return kv_heads, head_dim

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads: attention.num_kv_heads, or num_heads (MHA)."""
        kv = self.attention.num_kv_heads
        return self.num_heads if kv is None else kv

    def replace(self, **changes) -> TransformerConfig:
        """A copy with some fields changed (validated again).

        A sub-config field takes a sub-config, None (the optional ones: rope, t5, moe), or a
        dict of the sub-config fields to change, applied to the current sub-config (to its
        defaults when it is None): `config.replace(moe={"num_experts": 4}, d_model=128)`.
        A new `position` drops the `rope` / `t5` settings it does not use (unless given).
        """
        for name, value in changes.items():
            if isinstance(value, dict):
                if name not in SUBCONFIGS:
                    raise TypeError(f"{name} is not a sub-config: only {sorted(SUBCONFIGS)} "
                                    f"take a dict of changes")
                current = getattr(self, name, None)
                kind = SUBCONFIGS[name]
                changes[name] = (kind(**value) if current is None
                                 else dataclasses.replace(current, **value))
        if "position" in changes:
            for name, kind in _POSITION_PARTS.items():
                if changes["position"] != kind:
                    changes.setdefault(name, None)
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(TransformerConfig):
    """Causal language model (GPT-2, LLaMA, Mistral, Mixtral, Qwen, Gemma, ...): the only
    family whose attention may have a sparse `pattern` (see AttentionConfig; encoders may
    have a `sliding_window` and `layer_types` too), and the one that may use Transformer-XL
    relative attention (position="xl")."""

    logit_softcap: float | None = None
    """Logits become logit_softcap · tanh(logits / logit_softcap) (Gemma 2's
    final_logit_softcapping); None: uncapped."""
    latent: LatentConfig | None = None
    """Multi-head latent attention (DeepSeek-V2/V3) in every layer; None: attention with
    keys and values per KV head."""
    linear: LinearAttentionConfig | None = None
    """Gated DeltaNet, the token mixer of the "linear" layers of attention.layer_types
    (Qwen3-Next, Qwen3.5); None: a model without linear layers."""

    def __post_init__(self):
        super().__post_init__()
        cap = self.logit_softcap
        if cap is not None and not (isinstance(cap, int | float) and 0 < cap < float("inf")):
            raise ValueError(f"logit_softcap must be a finite number > 0 or None, got {cap!r}")
        if self.latent is not None:
            self._check_latent()
        self._check_linear()
        self._check_shared_kv()

    def _check_linear(self):
        """"linear" layers and the linear sub-config come together."""
        types = self.attention.layer_types or ()
        if ("linear" in types) != (self.linear is not None):
            raise ValueError("attention.layer_types has 'linear' layers only with a linear "
                             "sub-config (Gated DeltaNet) and a linear sub-config needs "
                             f"'linear' layers: got layer_types={types or None} and "
                             f"linear={self.linear}")

    def _check_shared_kv(self):
        """Layers that share keys and values attend those of an earlier layer of their type."""
        shared = self.attention.shared_kv_layers
        if not shared:
            return
        if shared >= self.num_layers:
            raise ValueError(f"attention.shared_kv_layers ({shared}) must be < num_layers "
                             f"({self.num_layers}): an earlier layer must own the keys")
        owners = {self.layer_type(i) for i in range(self.num_layers - shared)}
        sharers = {self.layer_type(i) for i in range(self.num_layers - shared, self.num_layers)}
        if not sharers <= owners - {"linear"} or self.latent is not None:
            raise ValueError(f"attention.shared_kv_layers: the last {shared} layers (types "
                             f"{sorted(sharers)}) need an earlier attention layer of each of "
                             f"their types (got {sorted(owners)}), and no latent attention")
        if self.compute.scan_layers:
            raise ValueError("attention.shared_kv_layers is not supported with "
                             "compute.scan_layers: scanned layers are of one kind, and sharing "
                             "layers have no key and value projections")

    def _check_latent(self):
        """What latent attention replaces or cannot combine with."""
        if self.position != "rope" or self.rope.fraction != 1.0:
            raise ValueError(f"latent attention rotates its qk_rope_head_dim features: it needs "
                             f"position='rope' with rope.fraction=1.0, got {self.position!r}")
        taken = {"attention.num_kv_heads": self.attention.num_kv_heads,
                 "attention.head_dim": self.attention.head_dim,
                 "attention.qkv_bias": self.attention.qkv_bias,
                 "attention.qk_norm": self.attention.qk_norm}
        for name, value in taken.items():
            if value is not None:
                raise ValueError(f"{name} has no meaning with latent attention (the latent "
                                 f"sub-config sizes the heads): set it to None, got {value!r}")
        for name in ("sinks", "output_gate"):
            if getattr(self.attention, name):
                raise ValueError(f"attention.{name} is not implemented for latent attention "
                                 f"(tfx.nn.LatentAttention takes no {name})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderConfig(TransformerConfig):
    """Bidirectional encoder (BERT, ModernBERT): token types, [CLS] pooler, tied MLM head;
    sliding-window layers see a window on either side."""

    type_vocab_size: int = 2
    """Segment (token type) ids are in [0, type_vocab_size); 0: no token types (ModernBERT)."""
    special_tokens: SpecialTokens = dataclasses.field(default_factory=SpecialTokens)
    """Ids of [PAD], [CLS], [SEP], [MASK]."""

    def __post_init__(self):
        super().__post_init__()
        positive_int("type_vocab_size", self.type_vocab_size, minimum=0)
        # An encoder's windows are bidirectional (see AttentionConfig.sliding_window).
        _not_decoder_only(self, ("pattern",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderDecoderConfig(TransformerConfig):
    """Encoder–decoder (T5, original Transformer): num_layers encoder layers and
    num_decoder_layers decoder layers (default: as many), cross-attention in every decoder
    layer. T5 scales the tied output head by d_model**-0.5 (`scale_tied_head`)."""

    num_decoder_layers: int | None = None
    """Decoder layers; None for num_layers."""
    decoder_start_token_id: int = 0
    """The token that decoder inputs start with."""
    scale_tied_head: bool = False
    """Scale the tied output head by d_model**-0.5 (T5)."""

    def __post_init__(self):
        super().__post_init__()
        _not_decoder_only(self)
        if self.num_decoder_layers is not None:
            positive_int("num_decoder_layers", self.num_decoder_layers)

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers


def nested(fields: dict) -> dict:
    """Field values by dotted name -> a model config's keyword arguments: {"d_model": 64,
    "moe.num_experts": 8, "norm.kind": "rms"} -> {"d_model": 64, "moe": MoeConfig(num_experts=8),
    "norm": NormConfig(kind="rms")}. Sub-config fields not named keep their defaults."""
    out, parts = {}, {}
    for name, value in fields.items():
        part, dot, field = name.partition(".")
        if not dot:
            out[name] = value
        elif part not in SUBCONFIGS:
            raise ValueError(f"{name}: {part!r} is not a sub-config ({sorted(SUBCONFIGS)})")
        else:
            parts.setdefault(part, {})[field] = value
    return {**out, **{part: SUBCONFIGS[part](**values) for part, values in parts.items()}}


def field_value(config: TransformerConfig, name: str):
    """The value of field `name` of `config`, dotted for a sub-config's ("norm.eps"); None
    when that sub-config is (the `rope` of a model without rotary positions)."""
    value = config
    for part in name.split("."):
        value = None if value is None else getattr(value, part)
    return value


def _check_part(config: TransformerConfig, name: str, kind: type) -> None:
    """Check the type of sub-config `name` (a dict of its fields becomes one); fill in /
    refuse position-specific ones."""
    value = getattr(config, name)
    if isinstance(value, dict):
        value = kind(**value)
        object.__setattr__(config, name, value)  # frozen: set once, here
    position_kind = _POSITION_PARTS.get(name)
    if position_kind is not None:
        if value is None and config.position == position_kind:
            object.__setattr__(config, name, kind())  # frozen: set once, here
            return
        if value is not None and config.position != position_kind:
            raise ValueError(f"{name} holds the settings of position={position_kind!r}, but "
                             f"position is {config.position!r}: set {name}=None (on the command "
                             f"line --model.{name}=None)")
    optional = name in OPTIONAL_SUBCONFIGS
    if not (isinstance(value, kind) or (optional and value is None)):
        raise TypeError(f"{name} must be a {kind.__name__}{' or None' if optional else ''} (or "
                        f"a dict of its fields), got {type(value).__name__}")


def _not_decoder_only(config: TransformerConfig,
                      attention_fields=("sliding_window", "pattern", "layer_types")) -> None:
    """Refuse what only causal decoders implement: Transformer-XL positions and the
    `attention_fields` named."""
    name = type(config).__name__
    if config.position == "xl":
        raise ValueError(f"position 'xl' (Transformer-XL relative attention) needs causal "
                         f"self-attention: use it in a DecoderConfig, not {name}")
    for field in attention_fields:
        if getattr(config.attention, field) is not None:
            raise ValueError(f"attention.{field} is for causal decoders (DecoderConfig), not "
                             f"{name}")
