"""How a layer mixes tokens: self-attention (`AttentionConfig`), multi-head latent attention in
its place (`LatentConfig`), and Gated DeltaNet, the linear attention of "linear" layers
(`LinearAttentionConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from tfx import names
from tfx.models.parts._checks import boolean, one_of, positive_int
from tfx.ops.attention import table as attention_table

__all__ = ["AttentionConfig", "AttentionImplementation", "LatentConfig", "LayerType",
           "LinearAttentionConfig", "QKNorm"]

# tfx.ops.attention.table: one line per kernel (jax-free).
AttentionImplementation = Literal[attention_table.IMPLEMENTATIONS]
# How a layer mixes tokens: attention to every earlier token ("full"), to the last
# attention.sliding_window ("sliding"), or Gated DeltaNet linear attention ("linear", decoders
# with a `linear` sub-config: Qwen3-Next, Qwen3.5).
LayerType = Literal["full", "sliding", "linear"]
# Where queries and keys are normalised (RMS over the norm kind's statistics): each head's
# head_dim features (Qwen 3, Gemma 3), or all heads' features at once (OLMo 2).
QKNorm = Literal[names.QK_NORMS]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Self-attention beyond its head count. `pattern` is for decoders only (DecoderConfig);
    `sliding_window` and `layer_types` for decoders and encoders (EncoderConfig)."""

    num_kv_heads: int | None = None
    """Key/value heads: None for num_heads (MHA), fewer for GQA, 1 for MQA."""
    head_dim: int | None = None
    """Width of a head; None for d_model // num_heads."""
    scale: float | None = None
    """Factor of the scores; None for 1/sqrt(head_dim) (T5: 1.0)."""
    implementation: AttentionImplementation | None = None
    """Kernel of `tfx.ops.dot_product_attention`; None for the platform's."""
    sliding_window: int | None = None
    """How far back a token attends (Mistral): a decoder's token sees the last sliding_window
    tokens, itself included; an encoder's sees those less than sliding_window positions away
    on either side (ModernBERT's local_attention // 2 + 1). None: full attention."""
    pattern: str | None = None
    """A sparse pattern in the text form of `tfx.ops.sparse.parse_spec` (e.g.
    "window:256|global:16|random:64,2", BigBird), intersected with the causal mask; for
    training and scoring (a KV cache cannot hold it)."""
    layer_types: tuple[LayerType, ...] | None = None
    """Per layer, "full", "sliding" (the last `sliding_window` tokens) or "linear" (Gated
    DeltaNet, `LinearAttentionConfig`): Gemma 2 alternates full and sliding layers, Gemma 3 has
    five sliding layers per full one, Qwen3-Next three linear ones. None: every layer "sliding"
    when sliding_window is set, else "full"."""
    softcap: float | None = None
    """Scores become softcap · tanh(scores / softcap) before the softmax (Gemma 2); None:
    uncapped."""
    qkv_bias: bool | None = None
    """Biases on the query, key and value projections; None: the model's use_bias (Qwen 2
    has them without an output or MLP bias)."""
    out_bias: bool | None = None
    """A bias on the output projection; None: the model's use_bias (Qwen 3's attention_bias
    puts biases on all four projections and none in the MLP)."""
    qk_norm: QKNorm | None = None
    """Normalise queries and keys before positions are applied (norm.kind, norm.eps):
    "per_head" (Qwen 3, Gemma 3) or "across_heads" (OLMo 2); None: not normalised."""
    sinks: bool = False
    """A learned sink logit per head (GPT-OSS): each softmax also counts a key of that score
    and value zero, so a head may attend to nothing (`tfx.ops.dot_product_attention`'s
    sinks)."""
    output_gate: bool = False
    """Each head's output multiplied by sigmoid of a projection of the layer's input
    (`tfx.nn.Attention`'s `gate`) before the output projection (Qwen3-Next, Qwen3.5, whose
    q_proj holds it beside each head's query)."""
    value_norm: bool = False
    """Values RMS-normalised over each head's head_dim, without a scale (Gemma 4; norm.eps)."""
    full_head_dim: int | None = None
    """Width of the heads of the "full" layers (Gemma 4's global_head_dim, with "sliding"
    layers of head_dim); None: head_dim."""
    full_kv_heads: int | None = None
    """Key/value heads of the "full" layers (Gemma 4's num_global_key_value_heads); None:
    num_kv_heads."""
    full_values_are_keys: bool = False
    """The "full" layers have no value projection: their values are the key projection's
    output, before the key norm and rotation (Gemma 4's attention_k_eq_v)."""
    shared_kv_layers: int = 0
    """The last shared_kv_layers layers (decoders) project no keys and values and cache none:
    each attends those of the last earlier layer of its layer type (Gemma 4's
    num_kv_shared_layers); 0: every layer has its own."""

    def __post_init__(self):
        for name in ("num_kv_heads", "head_dim", "sliding_window", "full_head_dim",
                     "full_kv_heads"):
            if getattr(self, name) is not None:
                positive_int(f"attention.{name}", getattr(self, name))
        one_of("attention.implementation", self.implementation,
               (None, *get_args(AttentionImplementation)))
        if self.pattern is not None:
            self._check_pattern()
        if self.softcap is not None and not (isinstance(self.softcap, int | float)
                                             and 0 < self.softcap < float("inf")):
            raise ValueError(f"attention.softcap must be a finite number > 0 or None, got "
                             f"{self.softcap!r}")
        for name in ("qkv_bias", "out_bias"):
            if getattr(self, name) is not None:
                boolean(f"attention.{name}", getattr(self, name))
        one_of("attention.qk_norm", self.qk_norm, (None, *get_args(QKNorm)))
        boolean("attention.sinks", self.sinks)
        boolean("attention.output_gate", self.output_gate)
        boolean("attention.value_norm", self.value_norm)
        boolean("attention.full_values_are_keys", self.full_values_are_keys)
        positive_int("attention.shared_kv_layers", self.shared_kv_layers, minimum=0)
        if self.layer_types is not None:
            self._check_layer_types()

    def _check_layer_types(self):
        kinds = self.layer_types
        if isinstance(kinds, list):  # a list from JSON or the command line: one value
            kinds = tuple(kinds)
            object.__setattr__(self, "layer_types", kinds)  # frozen: set once, here
        if not isinstance(kinds, tuple):
            raise TypeError(f"attention.layer_types must be a tuple of layer types or None, got "
                            f"{type(kinds).__name__}")
        for kind in kinds:
            one_of("attention.layer_types[...]", kind, get_args(LayerType))
        if "sliding" in kinds and self.sliding_window is None:
            raise ValueError("attention.layer_types has 'sliding' layers: set "
                             "attention.sliding_window")
        if self.pattern is not None:
            raise ValueError("give attention.layer_types or attention.pattern, not both")

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
class LatentConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, `tfx.nn.LatentAttention`) in place of
    attention with full keys and values: queries and per-head keys/values from low-rank
    projections, and a KV cache of the compressed latent plus one rotary key per token.
    The field names are Hugging Face's."""

    q_lora_rank: int | None = None
    """Width of the compressed query; None: a plain query projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the compressed latent that the cache stores."""
    qk_nope_head_dim: int = 128
    """Query/key features per head without position."""
    qk_rope_head_dim: int = 64
    """Rotary query/key features per head (the key's shared by the heads)."""
    v_head_dim: int = 128
    """Value features per head."""

    def __post_init__(self):
        if self.q_lora_rank is not None:
            positive_int("latent.q_lora_rank", self.q_lora_rank)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            positive_int(f"latent.{name}", getattr(self, name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearAttentionConfig:
    """Gated DeltaNet (`tfx.nn.GatedDeltaNet`), the token mixer of the "linear" layers of
    attention.layer_types (Qwen3-Next, Qwen3.5): a fixed-size recurrent state per head instead
    of a KV cache. The Hugging Face names are linear_num_value_heads, linear_num_key_heads,
    linear_key_head_dim, linear_value_head_dim and linear_conv_kernel_dim."""

    heads: int = 32
    """Value heads, each with its own delta-rule state [key_dim, value_dim]."""
    key_heads: int = 16
    """Query and key heads; they divide `heads`."""
    key_dim: int = 128
    """Features per query and key head."""
    value_dim: int = 128
    """Features per value head."""
    kernel_size: int = 4
    """Taps of the short causal convolution over queries, keys and values."""
    chunk_size: int = 64
    """Tokens per chunk of the chunked delta rule (training and prefill)."""

    def __post_init__(self):
        for name in ("heads", "key_heads", "key_dim", "value_dim", "kernel_size", "chunk_size"):
            positive_int(f"linear.{name}", getattr(self, name))
        if self.heads % self.key_heads:
            raise ValueError(f"linear.key_heads ({self.key_heads}) must divide linear.heads "
                             f"({self.heads})")
