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

from tfx import names
from tfx.ops.attention import table as attention_table

if TYPE_CHECKING:
    from tfx.ops.positional import RopeScaling
else:  # a runtime annotation that names no jax type (tyro reads it as a fixed field)
    RopeScaling = object

__all__ = ["COMPUTE_DTYPES", "REMAT_POLICIES", "Activation", "AttentionConfig",
           "AttentionImplementation", "ComputeConfig", "Dtype", "EmbeddingsConfig",
           "LatentConfig", "LayerType", "LinearAttentionConfig", "MlpConfig", "MoeConfig",
           "MoeDispatch", "MoePolicy",
           "NormConfig", "NormKind", "QKNorm", "RematPolicy", "RopeConfig", "RopeLayout",
           "SpecialTokens", "T5BiasConfig"]

# The names come from tfx.names (one source, jax-free), as tyro and the CLI read them.
Activation = Literal[names.ACTIVATIONS]
NormKind = Literal[names.NORMS]
RopeLayout = Literal[names.ROPE_LAYOUTS]
# tfx.ops.attention.table: one line per kernel (jax-free).
AttentionImplementation = Literal[attention_table.IMPLEMENTATIONS]
MoePolicy = Literal[names.MOE_POLICIES]
MoeDispatch = Literal[names.MOE_DISPATCHES]
# How a layer mixes tokens: attention to every earlier token ("full"), to the last
# attention.sliding_window ("sliding"), or Gated DeltaNet linear attention ("linear", decoders
# with a `linear` sub-config: Qwen3-Next, Qwen3.5).
LayerType = Literal["full", "sliding", "linear"]
# Where queries and keys are normalised (RMS over the norm kind's statistics): each head's
# head_dim features (Qwen 3, Gemma 3), or all heads' features at once (OLMo 2).
QKNorm = Literal[names.QK_NORMS]
# Floating-point dtypes by name; resolved to jnp dtypes where modules are built.
Dtype = Literal["float32", "bfloat16", "float16"]
COMPUTE_DTYPES = (None, *get_args(Dtype))
# What a rematerialised layer keeps from its forward pass for the backward pass; the rest is
# recomputed. jax's own policies (`jax.checkpoint_policies.<name>`), from the most recomputation
# to none, then tfx's, which keep the tensors that the layers tag with checkpoint names.
# tfx.nn.remat.POLICIES maps each name to its jax policy and says which tags it keeps.
REMAT_POLICIES = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable",
                  "everything_saveable", "save_attention_outputs", "save_qkv_proj",
                  "save_qkv_and_attention_outputs")
RematPolicy = Literal[REMAT_POLICIES]  # the tuple above, as tyro and the CLI read it
# GPT-OSS's gain of its clamped SwiGLU (MoeConfig.swiglu_alpha), the default.
_SWIGLU_ALPHA = 1.702


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
    local_theta: float | None = None
    """Base wavelength of the "sliding" layers (Gemma 3's rope_local_base_freq), which then
    rotate without `scaling`; None: every layer uses theta and scaling."""
    nope_layers: tuple[int, ...] = ()
    """Layers (0-based) whose self-attention rotates nothing: no positional encoding at all
    (NoPE, Kazemnejad et al. 2023), interleaved with rotating layers (SmolLM3: every fourth)."""

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
        if self.local_theta is not None and not self.local_theta > 0:
            raise ValueError(f"rope.local_theta must be > 0 or None, got {self.local_theta}")
        if not isinstance(self.nope_layers, tuple) or not all(
                isinstance(i, int) and i >= 0 for i in self.nope_layers):
            raise TypeError(f"rope.nope_layers must be a tuple of layer indices >= 0, got "
                            f"{self.nope_layers!r}")


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpConfig:
    """The feed-forward block (and the experts of a mixture)."""

    activation: Activation = "gelu"
    """Nonlinearity (`tfx.ops.activations.ACTIVATIONS`)."""
    gated: bool = False
    """A gated linear unit (SwiGLU with activation="silu")."""
    parallel: bool = False
    """The MLP reads the layer's input beside attention, x + attention(n1(x)) + mlp(n2(x))
    (GPT-NeoX, GPT-J), instead of the attention's output; pre-norm models only."""
    wide_shared: bool = False
    """The layers that attend another's keys (attention.shared_kv_layers) have MLPs of twice
    d_ff (Gemma 4's use_double_wide_mlp); False: every MLP has d_ff."""

    def __post_init__(self):
        one_of("mlp.activation", self.activation, get_args(Activation))
        boolean("mlp.gated", self.gated)
        boolean("mlp.parallel", self.parallel)
        boolean("mlp.wide_shared", self.wide_shared)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """A mixture of experts (tfx.ops.moe) in place of some layers' MLP. Experts are MLPs with
    the model's activation and gating, without biases unless `expert_bias`. The training
    losses' weights and the "deepseek" bias rate are training settings
    (tfx.train.config.TrainConfig)."""

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
    shared_gate: bool = False
    """The shared experts' output scaled per token by sigmoid(x · w), w a learned [d_model]
    vector (Qwen3-Next and Qwen3.5's shared_expert_gate); needs shared_experts."""
    first_dense: int = 0
    """The first layers keep a dense MLP of width d_ff (DeepSeek's first_k_dense_replace)."""
    renormalize: bool | None = None
    """Divide each token's k weights by their sum; None: when k > 1 (Mixtral), not at k = 1
    (Switch). Qwen 3 MoE's norm_topk_prob."""
    num_groups: int = 1
    """Experts form this many equal groups, of which a token may use `groups_per_token`
    (DeepSeek-V3's group-limited routing); 1: no groups."""
    groups_per_token: int = 1
    """Groups a token's experts may come from (DeepSeek-V3's topk_group)."""
    routed_scale: float = 1.0
    """Factor of the routed experts' weights (DeepSeek-V3's routed_scaling_factor)."""
    router_bias: bool = False
    """A bias on the router's logits (GPT-OSS)."""
    expert_bias: bool = False
    """Biases on each routed expert's gate, up and down projections (GPT-OSS)."""
    swiglu_limit: float | None = None
    """The routed experts' SwiGLU clamped as GPT-OSS's (`tfx.ops.moe.ClampedSwiGLU`; gated
    "silu" experts): g = min(gate, limit), u = clip(up, -limit, limit), hidden
    (u + 1) · g · sigmoid(swiglu_alpha · g); None: silu(gate) · up."""
    swiglu_alpha: float = _SWIGLU_ALPHA
    """Sigmoid gain of the clamped SwiGLU (GPT-OSS: 1.702, where g · sigmoid(1.702 g) ≈
    GELU); with swiglu_limit only."""

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
        boolean("moe.shared_gate", self.shared_gate)
        if self.shared_gate and not self.shared_experts:
            raise ValueError("moe.shared_gate scales the shared experts' output: set "
                             f"moe.shared_experts >= 1, got {self.shared_experts}")
        positive_int("moe.first_dense", self.first_dense, minimum=0)
        if self.renormalize is not None:
            boolean("moe.renormalize", self.renormalize)
        boolean("moe.router_bias", self.router_bias)
        boolean("moe.expert_bias", self.expert_bias)
        self._check_groups()
        self._check_swiglu()

    def _check_swiglu(self):
        for name in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float)
                                          and not isinstance(value, bool)
                                          and 0 < value < float("inf")):
                raise ValueError(f"moe.{name} must be a finite number > 0, got {value!r}")
        if self.swiglu_limit is None and self.swiglu_alpha != _SWIGLU_ALPHA:
            raise ValueError(f"moe.swiglu_alpha ({self.swiglu_alpha}) is the gain of the clamped "
                             "SwiGLU: set moe.swiglu_limit too")

    def _check_groups(self):
        positive_int("moe.num_groups", self.num_groups)
        positive_int("moe.groups_per_token", self.groups_per_token)
        if self.num_experts % self.num_groups:
            raise ValueError(f"moe.num_groups ({self.num_groups}) must divide moe.num_experts "
                             f"({self.num_experts})")
        if self.num_groups > 1 and self.policy != "deepseek":
            raise ValueError(f"moe.num_groups > 1 (group-limited routing) needs moe.policy "
                             f"'deepseek', got {self.policy!r}")
        if self.groups_per_token > self.num_groups:
            raise ValueError(f"moe.groups_per_token ({self.groups_per_token}) must be <= "
                             f"moe.num_groups ({self.num_groups})")
        if self.experts_per_token > self.groups_per_token * self.num_experts // self.num_groups:
            raise ValueError(f"moe.experts_per_token ({self.experts_per_token}) must be <= the "
                             f"experts of moe.groups_per_token groups")
        if not (isinstance(self.routed_scale, int | float) and self.routed_scale > 0):
            raise ValueError(f"moe.routed_scale must be a number > 0, got {self.routed_scale!r}")


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
    norm: bool = False
    """Pre-norm models normalise the embeddings too (ModernBERT), with the model's norm;
    post-norm models (BERT) always do."""
    per_layer_width: int | None = None
    """Per-layer embeddings (Gemma 4's PLE, `tfx.nn.per_layer_embeddings`; decoders): each
    layer gates an input of this width into its residual stream after its MLP, mixed from a
    table [per_layer_vocab_size, num_layers * width] and a projection of the main embedding
    (hidden_size_per_layer_input); None: no per-layer inputs."""
    per_layer_vocab_size: int | None = None
    """Rows of the per-layer table (vocab_size_per_layer_input); None: vocab_size."""

    def __post_init__(self):
        boolean("embeddings.tie", self.tie)
        boolean("embeddings.scale", self.scale)
        boolean("embeddings.norm", self.norm)
        for name in ("per_layer_width", "per_layer_vocab_size"):
            if getattr(self, name) is not None:
                positive_int(f"embeddings.{name}", getattr(self, name))
        if self.per_layer_vocab_size is not None and self.per_layer_width is None:
            raise ValueError("embeddings.per_layer_vocab_size needs embeddings.per_layer_width "
                             "(the per-layer embeddings it sizes)")
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
    remat_policy: RematPolicy = "nothing_saveable"
    """What a rematerialised layer keeps for its backward pass (tfx.nn.remat): from
    "nothing_saveable" (all recomputed) to "everything_saveable" (none), or the tensors a
    "save_*" policy names. Needs remat."""
    scan_layers: bool = False
    """Stack the layers' weights [num_layers, ...] and run them in nnx.scan: one layer
    compiled instead of num_layers."""

    def __post_init__(self):
        one_of("compute.dtype", self.dtype, COMPUTE_DTYPES)
        one_of("compute.param_dtype", self.param_dtype, get_args(Dtype))
        boolean("compute.remat", self.remat)
        one_of("compute.remat_policy", self.remat_policy, REMAT_POLICIES)
        if not self.remat and self.remat_policy != "nothing_saveable":
            raise ValueError(f"compute.remat_policy={self.remat_policy!r} applies to "
                             "rematerialised layers only: set compute.remat=True too")
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
