"""The sub-configs of a model config, one per concern: frozen dataclasses, each validated in
`__post_init__` with messages that name the field by its dotted path in the model config
(`moe.num_experts`, `rope.theta`, ...). `tfx.models.config` assembles them."""

from __future__ import annotations

import dataclasses

from tfx.nn.mlp import ACTIVATIONS
from tfx.nn.norms import NORMS
from tfx.ops import moe
from tfx.ops.attention import IMPLEMENTATIONS
from tfx.ops.positional import RopeScaling
from tfx.ops.sparse import parse_spec

__all__ = ["COMPUTE_DTYPES", "AttentionConfig", "ComputeConfig", "EmbeddingsConfig",
           "MlpConfig", "MoeConfig", "NormConfig", "RopeConfig", "SpecialTokens",
           "T5BiasConfig"]

COMPUTE_DTYPES = (None, "float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary positions (position="rope"): `theta` the base wavelength, `layout` "half"
    (rotate_half, LLaMA/NeoX) or "interleaved" (pairs, RoFormer/GPT-J), `scaling` a
    `tfx.ops.positional` scaling object (linear, ntk, dynamic, yarn, llama3) or None, and
    `fraction` of each head's dimensions rotated (GPT-NeoX's rotary_pct)."""

    theta: float = 10000.0
    layout: str = "half"
    scaling: RopeScaling | None = None
    fraction: float = 1.0

    def __post_init__(self):
        if not self.theta > 0:
            raise ValueError(f"rope.theta must be > 0, got {self.theta}")
        one_of("rope.layout", self.layout, ("half", "interleaved"))
        if self.scaling is not None and not isinstance(self.scaling, RopeScaling):
            raise TypeError(f"rope.scaling must be a RopeScaling or None, got "
                            f"{type(self.scaling).__name__}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"rope.fraction must be in (0, 1], got {self.fraction}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class T5BiasConfig:
    """T5's relative attention bias (position="t5"): offsets fall into `num_buckets` buckets,
    logarithmically spaced up to `max_distance`."""

    num_buckets: int = 32
    max_distance: int = 128

    def __post_init__(self):
        positive_int("t5.num_buckets", self.num_buckets)
        positive_int("t5.max_distance", self.max_distance)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Self-attention beyond its head count: `num_kv_heads` (None: num_heads, MHA; fewer:
    GQA; 1: MQA), `head_dim` (None: d_model // num_heads), `scale` of the scores (None:
    1/sqrt(head_dim); T5: 1.0), the kernel `implementation` (see
    `tfx.ops.dot_product_attention`; None: the platform's).

    Decoders only (DecoderConfig): `sliding_window` limits how far back a token attends
    (Mistral), None for full causal attention; `pattern` is a sparse pattern instead, in the
    text form of `tfx.ops.sparse.parse_spec` (e.g. "window:256|global:16|random:64,2",
    BigBird), intersected with the causal mask: for training and scoring, as a KV cache cannot
    hold it (decoding with a cache raises).
    """

    num_kv_heads: int | None = None
    head_dim: int | None = None
    scale: float | None = None
    implementation: str | None = None
    sliding_window: int | None = None
    pattern: str | None = None

    def __post_init__(self):
        for name in ("num_kv_heads", "head_dim", "sliding_window"):
            if getattr(self, name) is not None:
                positive_int(f"attention.{name}", getattr(self, name))
        one_of("attention.implementation", self.implementation, (None, *IMPLEMENTATIONS))
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
        try:
            parse_spec(self.pattern)
        except ValueError as e:
            raise ValueError(f"attention.pattern: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpConfig:
    """The feed-forward block (and the experts of a mixture): `activation` (a name of
    `tfx.nn.mlp.ACTIVATIONS`), `gated` for GLU variants (SwiGLU with "silu")."""

    activation: str = "gelu"
    gated: bool = False

    def __post_init__(self):
        one_of("mlp.activation", self.activation, tuple(ACTIVATIONS))
        boolean("mlp.gated", self.gated)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NormConfig:
    """Normalisation: `kind` "layer" or "rms", `eps`, and `pre_norm` (x + f(norm(x)): GPT-2,
    LLaMA, T5) or post-norm (norm(x + f(x)): BERT, the original Transformer)."""

    kind: str = "layer"
    eps: float = 1e-5
    pre_norm: bool = True

    def __post_init__(self):
        one_of("norm.kind", self.kind, NORMS)
        if not self.eps > 0:
            raise ValueError(f"norm.eps must be > 0, got {self.eps}")
        boolean("norm.pre_norm", self.pre_norm)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """A mixture of experts (tfx.ops.moe) in place of the MLP of layer i (0-based) when
    (i + 1) % every == 0. Experts are MLPs of width `d_ff` (None: the model's d_ff) with the
    model's activation and gating and no biases; each token goes to `experts_per_token` of
    `num_experts` by the router `policy` ("topk", "gshard", "deepseek"), with `jitter` noise
    on the router logits in training; `capacity_factor` None is dropless; `dispatch` is
    `tfx.ops.moe.experts_ffn`'s implementation (None: the platform's); `shared_experts` are
    always active beside the routed ones (DeepSeek). The training losses' weights and the
    "deepseek" bias rate are training settings (tfx.train.config.TrainConfig)."""

    num_experts: int = 8
    experts_per_token: int = 2
    every: int = 1
    d_ff: int | None = None
    capacity_factor: float | None = None
    policy: str = "topk"
    jitter: float = 0.0
    dispatch: str | None = None
    shared_experts: int = 0

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
        one_of("moe.policy", self.policy, moe.POLICIES)
        if self.policy == "gshard" and self.experts_per_token != 2:
            raise ValueError("moe.policy 'gshard' routes to 2 experts: moe.experts_per_token "
                             f"must be 2, got {self.experts_per_token}")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"moe.jitter must be in [0, 1), got {self.jitter}")
        one_of("moe.dispatch", self.dispatch, (None, *moe.IMPLEMENTATIONS))
        positive_int("moe.shared_experts", self.shared_experts, minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingsConfig:
    """The token embedding table: `tie` it to the output head; `scale` the token embeddings
    by sqrt(d_model), as Vaswani et al. 2017 do: with small embeddings (std 0.02) and
    sinusoidal positions of magnitude 1, the positions would otherwise drown which token it
    is."""

    tie: bool = True
    scale: bool = False

    def __post_init__(self):
        boolean("embeddings.tie", self.tie)
        boolean("embeddings.scale", self.scale)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeConfig:
    """How the model runs. `dtype`: compute dtype, e.g. "bfloat16"; None: the platform's
    default (`tfx.models.config.compute_dtype`: bfloat16 on GPU/TPU, float32 on CPU);
    parameters stay in `param_dtype` either way. `remat`: rematerialise each layer in the
    backward pass. `scan_layers`: stack layer weights [num_layers, ...] and run them in
    nnx.scan (one layer compiled instead of num_layers)."""

    dtype: str | None = None
    param_dtype: str = "float32"
    remat: bool = False
    scan_layers: bool = False

    def __post_init__(self):
        one_of("compute.dtype", self.dtype, COMPUTE_DTYPES)
        one_of("compute.param_dtype", self.param_dtype, ("float32", "bfloat16", "float16"))
        boolean("compute.remat", self.remat)
        boolean("compute.scan_layers", self.scan_layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecialTokens:
    """An encoder's special token ids (BERT's vocabulary by default), for masked-LM training
    and for building inputs: [PAD], [CLS], [SEP], [MASK]."""

    pad_id: int = 0
    cls_id: int = 101
    sep_id: int = 102
    mask_id: int = 103

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
