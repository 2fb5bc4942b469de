"""The sub-configs of a model config, one per concern: frozen dataclasses, each validated in
`__post_init__` with messages that name the field by its dotted path in the model config
(`moe.num_experts`, `rope.theta`, ...). `tfx.models.config` assembles them.

This module imports neither jax nor flax, so that `tfx train --help` starts quickly. The
choices of a field are `typing.Literal` types; the tables that give them their behaviour live
in tfx/nn and tfx/ops (`tfx.ops.activations.ACTIVATIONS`, `tfx.nn.norms.NORMS`, ...), and
tests/models/test_config_literals.py checks that the two agree.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from tfx.ops.positional import RopeScaling
else:  # a runtime annotation that names no jax type (tyro reads it as a fixed field)
    RopeScaling = object

__all__ = ["COMPUTE_DTYPES", "Activation", "AttentionConfig", "AttentionImplementation",
           "ComputeConfig", "Dtype", "EmbeddingsConfig", "MlpConfig", "MoeConfig",
           "MoeDispatch", "MoePolicy", "NormConfig", "NormKind", "RopeConfig", "RopeLayout",
           "SpecialTokens", "T5BiasConfig"]

# The names of tfx.ops.activations.ACTIVATIONS.
Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
# tfx.nn.norms.NORMS.
NormKind = Literal["layer", "rms"]
# tfx.ops.positional.rope.LAYOUTS.
RopeLayout = Literal["half", "interleaved"]
# tfx.ops.attention.IMPLEMENTATIONS.
AttentionImplementation = Literal["reference", "blocked", "cudnn", "pallas_gpu", "splash",
                                  "context_parallel"]
# tfx.ops.moe.POLICIES and tfx.ops.moe.IMPLEMENTATIONS.
MoePolicy = Literal["topk", "gshard", "deepseek"]
MoeDispatch = Literal["sorted", "onehot", "ragged", "megablox"]
# Floating-point dtypes by name; resolved to jnp dtypes where modules are built.
Dtype = Literal["float32", "bfloat16", "float16"]
COMPUTE_DTYPES = (None, *get_args(Dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary positions (position="rope"), as `tfx.ops.positional.apply_rope` takes them."""

    theta: float = 10000.0
    """Base wavelength of the rotations."""
    layout: RopeLayout = "half"
    """Which dimensions pair up: "half" (rotate_half, LLaMA/NeoX) or "interleaved" (RoFormer,
    GPT-J)."""
    scaling: RopeScaling | None = None
    """A `tfx.ops.positional` scaling object (linear, ntk, dynamic, yarn, llama3) or None."""
    fraction: float = 1.0
    """Fraction of each head's dimensions rotated (GPT-NeoX's rotary_pct)."""

    def __post_init__(self):
        if not self.theta > 0:
            raise ValueError(f"rope.theta must be > 0, got {self.theta}")
        one_of("rope.layout", self.layout, get_args(RopeLayout))
        if self.scaling is not None:
            from tfx.ops.positional import RopeScaling  # a scaling object: jax is loaded

            if not isinstance(self.scaling, RopeScaling):
                raise TypeError(f"rope.scaling must be a RopeScaling or None, got "
                                f"{type(self.scaling).__name__}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"rope.fraction must be in (0, 1], got {self.fraction}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class T5BiasConfig:
    """T5's relative attention bias (position="t5")."""

    num_buckets: int = 32
    """Buckets that key-minus-query offsets fall into, logarithmically spaced."""
    max_distance: int = 128
    """Offsets from this distance on share the last bucket."""

    def __post_init__(self):
        positive_int("t5.num_buckets", self.num_buckets)
        positive_int("t5.max_distance", self.max_distance)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Self-attention beyond its head count. `sliding_window` and `pattern` are for decoders
    only (DecoderConfig)."""

    num_kv_heads: int | None = None
    """Key/value heads: None for num_heads (MHA), fewer for GQA, 1 for MQA."""
    head_dim: int | None = None
    """Width of a head; None for d_model // num_heads."""
    scale: float | None = None
    """Factor of the scores; None for 1/sqrt(head_dim) (T5: 1.0)."""
    implementation: AttentionImplementation | None = None
    """Kernel of `tfx.ops.dot_product_attention`; None for the platform's."""
    sliding_window: int | None = None
    """How far back a token attends (Mistral); None for full causal attention."""
    pattern: str | None = None
    """A sparse pattern in the text form of `tfx.ops.sparse.parse_spec` (e.g.
    "window:256|global:16|random:64,2", BigBird), intersected with the causal mask; for
    training and scoring (a KV cache cannot hold it)."""

    def __post_init__(self):
        for name in ("num_kv_heads", "head_dim", "sliding_window"):
            if getattr(self, name) is not None:
                positive_int(f"attention.{name}", getattr(self, name))
        one_of("attention.implementation", self.implementation,
               (None, *get_args(AttentionImplementation)))
        if self.pattern is not None:
            self._check_pattern()

    def _check_pattern(self):
        if not isinstance(self.pattern, str):
            raise TypeError(f"attention.pattern must be a str or None, got "
                            f"{type(self.pattern).__name__}")
        if self.sliding_window is not None:
            raise ValueError(f"give attention.sliding_window ({self.sliding_window}) or "
                             f"attention.pattern ({self.pattern!r}), not both: a window can be "
                             f"a part of the pattern, 'window:{self.sliding_window}|...'")
        from tfx.ops.sparse import parse_spec  # only for a pattern: keeps the import light

        try:
            parse_spec(self.pattern)
        except ValueError as e:
            raise ValueError(f"attention.pattern: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpConfig:
    """The feed-forward block (and the experts of a mixture)."""

    activation: Activation = "gelu"
    """Nonlinearity (`tfx.ops.activations.ACTIVATIONS`)."""
    gated: bool = False
    """A gated linear unit (SwiGLU with activation="silu")."""

    def __post_init__(self):
        one_of("mlp.activation", self.activation, get_args(Activation))
        boolean("mlp.gated", self.gated)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NormConfig:
    """Normalisation layers."""

    kind: NormKind = "layer"
    """LayerNorm ("layer") or RMSNorm ("rms")."""
    eps: float = 1e-5
    """Added to the variance (BERT 1e-12, GPT-2 1e-5, T5 1e-6)."""
    pre_norm: bool = True
    """x + f(norm(x)) (GPT-2, LLaMA, T5); False: norm(x + f(x)) (BERT, Vaswani et al.)."""

    def __post_init__(self):
        one_of("norm.kind", self.kind, get_args(NormKind))
        if not self.eps > 0:
            raise ValueError(f"norm.eps must be > 0, got {self.eps}")
        boolean("norm.pre_norm", self.pre_norm)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """A mixture of experts (tfx.ops.moe) in place of some layers' MLP. Experts are MLPs with
    the model's activation and gating and no biases. The training losses' weights and the
    "deepseek" bias rate are training settings (tfx.train.config.TrainConfig)."""

    num_experts: int = 8
    """Routed experts per layer."""
    experts_per_token: int = 2
    """Experts that each token goes to."""
    every: int = 1
    """Layer i (0-based) has experts when (i + 1) % every == 0."""
    d_ff: int | None = None
    """Width of an expert; None for the model's d_ff."""
    capacity_factor: float | None = None
    """Tokens an expert takes, as a multiple of its fair share; None: dropless."""
    policy: MoePolicy = "topk"
    """Router: top-k, GShard's top-2, or DeepSeek's bias-balanced top-k."""
    jitter: float = 0.0
    """Noise on the router logits in training."""
    dispatch: MoeDispatch | None = None
    """Implementation of `tfx.ops.moe.experts_ffn`; None for the platform's."""
    shared_experts: int = 0
    """Experts that every token uses beside the routed ones (DeepSeek)."""

    def __post_init__(self):
        for name in ("num_experts", "experts_per_token", "every"):
            positive_int(f"moe.{name}", getattr(self, name))
        if self.d_ff is not None:
            positive_int("moe.d_ff", self.d_ff)
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"moe.experts_per_token ({self.experts_per_token}) must be <= "
                             f"moe.num_experts ({self.num_experts})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"moe.capacity_factor must be > 0 or None (dropless), got "
                             f"{self.capacity_factor}")
        one_of("moe.policy", self.policy, get_args(MoePolicy))
        if self.policy == "gshard" and self.experts_per_token != 2:
            raise ValueError("moe.policy 'gshard' routes to 2 experts: moe.experts_per_token "
                             f"must be 2, got {self.experts_per_token}")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"moe.jitter must be in [0, 1), got {self.jitter}")
        one_of("moe.dispatch", self.dispatch, (None, *get_args(MoeDispatch)))
        positive_int("moe.shared_experts", self.shared_experts, minimum=0)


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

    def __post_init__(self):
        boolean("embeddings.tie", self.tie)
        boolean("embeddings.scale", self.scale)
        if self.pad_id is not None:
            positive_int("embeddings.pad_id", self.pad_id, minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeConfig:
    """How the model runs. Dtypes are names, resolved where the modules are built
    (`tfx.models.config.compute_dtype`)."""

    dtype: Dtype | None = None
    """Compute dtype; None for the platform's default (bfloat16 on GPU/TPU, float32 on CPU)."""
    param_dtype: Dtype = "float32"
    """Storage dtype of the parameters."""
    remat: bool = False
    """Rematerialise each layer in the backward pass (less memory, more compute)."""
    scan_layers: bool = False
    """Stack the layers' weights [num_layers, ...] and run them in nnx.scan: one layer
    compiled instead of num_layers."""

    def __post_init__(self):
        one_of("compute.dtype", self.dtype, COMPUTE_DTYPES)
        one_of("compute.param_dtype", self.param_dtype, get_args(Dtype))
        boolean("compute.remat", self.remat)
        boolean("compute.scan_layers", self.scan_layers)


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


def positive_int(name: str, value, minimum: int = 1) -> None:
    """TypeError unless `value` is an int (not a bool); ValueError when below `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def one_of(name: str, value, allowed: tuple) -> None:
    """ValueError unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def boolean(name: str, value) -> None:
    """TypeError unless `value` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
