"""Model configurations: one frozen, validated dataclass per family, with named presets.

Fields shared by every family live in `TransformerConfig`; `EncoderConfig` (BERT),
`DecoderConfig` (GPT-2 / LLaMA / Mistral) and `EncoderDecoderConfig` (T5, original Transformer)
add their own. Every field is validated in `__post_init__` with a message naming it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from tfx.nn.mlp import ACTIVATIONS
from tfx.nn.norms import NORMS
from tfx.ops import moe
from tfx.ops.attention import IMPLEMENTATIONS
from tfx.ops.backends import default_compute_dtype
from tfx.ops.positional import RopeScaling
from tfx.ops.sparse import parse_spec

__all__ = ["COMPUTE_DTYPES", "POSITIONS", "DecoderConfig", "EncoderConfig",
           "EncoderDecoderConfig", "TransformerConfig", "compute_dtype"]

# How a model knows where tokens are: added to the embeddings ("learned", "sinusoidal"), rotated
# into queries and keys ("rope"), added to the scores ("alibi", "t5", and Transformer-XL's
# relative attention "xl", decoders only), or not at all ("none", NoPE).
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "t5", "xl", "none")

COMPUTE_DTYPES = (None, "float32", "bfloat16", "float16")


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
    if config_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {config_dtype!r}")
    dtype = config_dtype or default_compute_dtype(platform)
    return None if dtype is None else jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Fields shared by every family. Widths: d_model = hidden size, d_ff = MLP hidden size."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    num_kv_heads: int | None = None  # None: num_heads (MHA)
    head_dim: int | None = None  # None: d_model // num_heads
    max_len: int = 2048  # learned positions: table size; otherwise informative
    position: str = "learned"
    rope_theta: float = 10000.0
    rope_layout: str = "half"
    rope_scaling: RopeScaling | None = None
    rope_fraction: float = 1.0
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    activation: str = "gelu"
    gated_mlp: bool = False
    norm: str = "layer"
    norm_eps: float = 1e-5
    pre_norm: bool = True
    use_bias: bool = True  # attention and MLP projections
    attention_scale: float | None = None  # None: 1/sqrt(head_dim); T5: 1.0
    dropout: float = 0.0
    tie_embeddings: bool = True
    # Multiply token embeddings by sqrt(d_model), as Vaswani et al. 2017 do: with small
    # embeddings (std 0.02) and sinusoidal positions of magnitude 1, the positions would
    # otherwise drown which token it is.
    scale_embeddings: bool = False
    implementation: str | None = None  # attention kernel, see tfx.ops.dot_product_attention
    # Compute dtype, e.g. "bfloat16". None: the platform's default (`compute_dtype`): bfloat16
    # on GPU/TPU, float32 on CPU. Parameters stay in param_dtype either way.
    dtype: str | None = None
    param_dtype: str = "float32"
    remat: bool = False  # rematerialise each layer in the backward pass
    scan_layers: bool = False  # stack layer weights [num_layers, ...] and run them in nnx.scan
    # Mixture of experts (tfx.ops.moe): with num_experts > 0, layer i (0-based) has an MoE in
    # place of its MLP when (i + 1) % moe_every == 0; experts are MLPs of width moe_d_ff
    # (default d_ff) with the activation and gating above, and no biases.
    num_experts: int = 0
    experts_per_token: int = 2
    moe_every: int = 1
    moe_d_ff: int | None = None
    capacity_factor: float | None = None  # None: dropless
    router_policy: str = "topk"
    router_jitter: float = 0.0
    moe_dispatch: str | None = None  # tfx.ops.moe.experts_ffn's implementation; None: platform's
    moe_shared_experts: int = 0  # always-active experts beside the routed ones (DeepSeek)
    router_bias_rate: float = 0.001  # "deepseek" policy: selection-bias step per train step
    load_balancing_weight: float = 0.01  # weights of the auxiliary losses in the training loss
    router_z_weight: float = 0.001

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len",
                     "t5_num_buckets", "t5_max_distance"):
            _positive_int(name, getattr(self, name))
        if self.num_kv_heads is not None:
            _positive_int("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads})")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads "
                             f"({self.num_heads}) unless head_dim is given")
        _one_of("position", self.position, POSITIONS)
        _one_of("activation", self.activation, tuple(ACTIVATIONS))
        _one_of("norm", self.norm, NORMS)
        _one_of("rope_layout", self.rope_layout, ("half", "interleaved"))
        _one_of("implementation", self.implementation, (None, *IMPLEMENTATIONS))
        _one_of("dtype", self.dtype, COMPUTE_DTYPES)
        _one_of("param_dtype", self.param_dtype, ("float32", "bfloat16", "float16"))
        if not isinstance(self.scale_embeddings, bool):
            raise TypeError(f"scale_embeddings must be a bool, got "
                            f"{type(self.scale_embeddings).__name__}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if not 0.0 < self.rope_fraction <= 1.0:
            raise ValueError(f"rope_fraction must be in (0, 1], got {self.rope_fraction}")
        self._check_moe()

    def _check_moe(self):
        _positive_int("num_experts", self.num_experts, minimum=0)
        for name in ("experts_per_token", "moe_every"):
            _positive_int(name, getattr(self, name))
        if self.moe_d_ff is not None:
            _positive_int("moe_d_ff", self.moe_d_ff)
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be <= "
                             f"num_experts ({self.num_experts})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None (dropless), got "
                             f"{self.capacity_factor}")
        _one_of("router_policy", self.router_policy, moe.POLICIES)
        if self.router_policy == "gshard" and self.experts_per_token != 2:
            raise ValueError("router_policy 'gshard' routes to 2 experts: experts_per_token "
                             f"must be 2, got {self.experts_per_token}")
        if not 0.0 <= self.router_jitter < 1.0:
            raise ValueError(f"router_jitter must be in [0, 1), got {self.router_jitter}")
        _one_of("moe_dispatch", self.moe_dispatch, (None, *moe.IMPLEMENTATIONS))
        _positive_int("moe_shared_experts", self.moe_shared_experts, minimum=0)
        for name in ("load_balancing_weight", "router_z_weight", "router_bias_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_experts and self.scan_layers and self.moe_every != 1:
            raise ValueError(f"scan_layers runs one kind of layer: with num_experts > 0 it needs "
                             f"moe_every=1, got {self.moe_every}")

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) has a mixture of experts in place of its MLP."""
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def replace(self, **changes) -> TransformerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(TransformerConfig):
    """Causal language model (GPT-2, LLaMA, Mistral): sliding_window limits how far back a
    token attends (Mistral), None for full causal attention.

    attention_pattern: a sparse attention pattern instead, in the text form of
    `tfx.ops.sparse.parse_spec` (e.g. "window:256|global:16|random:64,2", BigBird), intersected
    with the causal mask. For training and scoring: a KV cache cannot hold it, so decoding with
    a cache (generation) raises.
    """

    sliding_window: int | None = None
    attention_pattern: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        if self.attention_pattern is not None:
            self._check_attention_pattern()

    def _check_attention_pattern(self):
        if not isinstance(self.attention_pattern, str):
            raise TypeError(f"attention_pattern must be a str or None, got "
                            f"{type(self.attention_pattern).__name__}")
        if self.sliding_window is not None:
            raise ValueError(f"give sliding_window ({self.sliding_window}) or attention_pattern "
                             f"({self.attention_pattern!r}), not both: a window can be a part of "
                             f"the pattern, 'window:{self.sliding_window}|...'")
        try:
            parse_spec(self.attention_pattern)
        except ValueError as e:
            raise ValueError(f"attention_pattern: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderConfig(TransformerConfig):
    """Bidirectional encoder (BERT): token types, [CLS] pooler, tied MLM head."""

    type_vocab_size: int = 2
    pad_token_id: int = 0
    cls_token_id: int = 101
    sep_token_id: int = 102
    mask_token_id: int = 103

    def __post_init__(self):
        super().__post_init__()
        _positive_int("type_vocab_size", self.type_vocab_size)
        _causal_only(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderDecoderConfig(TransformerConfig):
    """Encoder–decoder (T5, original Transformer): num_layers encoder layers and
    num_decoder_layers decoder layers (default: as many), cross-attention in every decoder
    layer. T5 scales the tied output head by d_model**-0.5 (`scale_tied_head`)."""

    num_decoder_layers: int | None = None
    decoder_start_token_id: int = 0
    scale_tied_head: bool = False

    def __post_init__(self):
        super().__post_init__()
        _causal_only(self)
        if self.num_decoder_layers is not None:
            _positive_int("num_decoder_layers", self.num_decoder_layers)

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _causal_only(config: TransformerConfig) -> None:
    if config.position == "xl":
        raise ValueError(f"position 'xl' (Transformer-XL relative attention) needs causal "
                         f"self-attention: use it in a DecoderConfig, not {type(config).__name__}")


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
