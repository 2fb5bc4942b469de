"""Qwen3-Next (`Qwen3NextForCausalLM`) checkpoints <-> tfx `Decoder`, and the hybrid parts that
Qwen3.5 (`tfx.hf.qwen3_5`) shares with it.

Both are Qwen 3 decoders (`tfx.hf.qwen`: SwiGLU MLPs, grouped-query attention with per-head
q_norm / k_norm, the "half" rotary layout, torch [out, in] weights transposed into nnx kernels)
whose layers come in two kinds (their cards: `tfx.models.families.QWEN3_NEXT`, `QWEN3_5`,
`QWEN3_5_MOE`):

- layer_types "linear_attention" / "full_attention" (when absent, every
  full_attention_interval-th layer, 4 by default, is full) -> attention.layer_types "linear" /
  "full". A linear layer is Gated DeltaNet (`tfx.nn.GatedDeltaNet`, sized by the `linear`
  sub-config: linear_num_value_heads -> linear.heads, linear_num_key_heads -> key_heads,
  linear_key_head_dim -> key_dim, linear_value_head_dim -> value_dim, linear_conv_kernel_dim
  -> kernel_size). Its tensors, `model.layers.{i}.linear_attn.`: conv1d.weight [C, 1, K] ->
  attention/conv [K, C]; A_log -> a_log, dt_bias -> dt_bias; norm.weight (a plain RMSNorm
  weight) -> norm_scale; out_proj -> out. Qwen3-Next fuses the projections per key head:
  in_proj_qkvz's rows are [key_heads, (query key_dim, key key_dim, group · value_dim values,
  group · value_dim gates)] and in_proj_ba's [key_heads, (group β, group decay)], group =
  heads // key_heads -> query, key, value, gate, beta, decay; Qwen3.5 keeps them apart
  (in_proj_qkv rows [query | key | value], in_proj_z -> gate, in_proj_b -> beta, in_proj_a
  -> decay).
- full layers gate their output: q_proj's rows are [heads, (query head_dim, gate head_dim)]
  -> attention/query and attention/gate (attention.output_gate: out = attention ·
  sigmoid(gate) before o_proj); its bias likewise with attention_bias.
- RMSNorms that multiply by (1 + weight) (input_layernorm, post_attention_layernorm,
  model.norm, q_norm, k_norm): loading sets tfx's scale = 1 + weight, saving writes
  weight = scale - 1, in float32 as `tfx.hf.gemma` does. The Gated DeltaNet's own norm is
  plain.
- partial rotary positions: partial_rotary_factor (in rope_parameters or top-level; 0.25 when
  config.json names none) -> rope.fraction.

Qwen3-Next's MLPs are Qwen 3 MoE's (`tfx.hf.qwen`): experts in layer i when i is not in
mlp_only_layers (a prefix only: moe.first_dense) and (i + 1) % decoder_sparse_step == 0, a
softmax top-k router renormalised with norm_topk_prob, experts per expert on disk
(`mlp.experts.{j}.gate_proj|up_proj|down_proj`, or fused in memory: both read, the per-expert
layout written), dense layers of width intermediate_size. Beside them a shared expert behind a
sigmoid gate: `mlp.shared_expert.gate_proj|up_proj|down_proj` -> mlp/shared (an MLP of width
moe.shared_experts · moe.d_ff, so shared_expert_intermediate_size must be a whole multiple of
moe_intermediate_size), `mlp.shared_expert_gate.weight` [1, d] -> mlp/shared_gate/kernel
(moe.shared_gate). Multi-token-prediction tensors (`mtp.*`) are not read, as transformers
does not read them.

Refused (ValueError naming the field): another hidden_act (also the convolution's activation),
layer types other than the two or none linear, rope types tfx lacks, a shared expert of a width
that is no multiple of moe_intermediate_size, mlp_only_layers beyond a prefix, no layer with
experts; on save, what the card lacks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from tfx.hf import decoder_parts, gemma, mixtral, plan, qwen
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "CARD", "HAS_EXPERTS", "HYBRID_DEFAULTS", "IGNORED",
           "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf", "hybrid_fields", "hybrid_steps",
           "hybrid_tensors", "hybrid_to_hf", "moe_to_hf", "packed_kernels", "params_from_hf",
           "params_to_hf", "shared_experts", "steps", "tensor_names"]

ARCHITECTURES = ("Qwen3NextForCausalLM",)
HAS_EXPERTS = True  # its models have experts, `moe` (tfx.hf.save)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
# Rotary buffers of older checkpoints; the multi-token-prediction head, which transformers
# does not load either.
IGNORED = (*decoder_parts.IGNORED, r"mtp\..*")
CARD = families.QWEN3_NEXT  # what every Qwen3-Next is: set on load, checked on save

_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}
_HF_LAYER_TYPES = {kind: name for name, kind in _LAYER_TYPES.items()}
_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
_MLP = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# A Gated DeltaNet layer's tensors stored as they are (but for the kernel's transpose).
_LINEAR = {("a_log",): "A_log", ("dt_bias",): "dt_bias", ("norm_scale",): "norm.weight",
           ("out", "kernel"): "out_proj.weight"}
# What Qwen3NextConfig and Qwen3.5's config classes share by default.
HYBRID_DEFAULTS = dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, attention_bias=False, head_dim=256,
                       linear_conv_kernel_dim=4, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_num_key_heads=16,
                       linear_num_value_heads=32)
_PARTIAL_ROTARY = 0.25  # the config classes' partial_rotary_factor when none is named
_FULL_EVERY = 4  # their full_attention_interval: every fourth layer is full
# Qwen3NextConfig's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(HYBRID_DEFAULTS, vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                 num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                 decoder_sparse_step=1, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512,
                 norm_topk_prob=True, mlp_only_layers=None, router_aux_loss_coef=0.001)


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """Qwen3NextConfig fields (config.json as a dict) -> DecoderConfig; dropout off."""
    hf = {**_DEFAULTS, **hf}
    return decoder_parts.from_card(CARD, {**hybrid_fields(hf, architecture),
                                          **_moe_fields(hf, architecture)})


def hybrid_fields(hf: dict, architecture: str) -> dict:
    """The DecoderConfig fields (by dotted name) of a Qwen3-Next / Qwen3.5 config.json whose
    defaults are filled in, but for the experts: sizes, rope, layer kinds, Gated DeltaNet,
    attention biases."""
    decoder_parts.check_silu(hf, architecture)  # also the convolution's activation
    head_dim = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    rope = decoder_parts.rope_parameters(
        {**hf, "partial_rotary_factor": hf.get("partial_rotary_factor", _PARTIAL_ROTARY)})
    bias = bool(hf["attention_bias"])  # q (with its gate), k, v and o alike
    return {**decoder_parts.common_fields({**hf, "head_dim": head_dim}),
            "rope.theta": float(rope.get("rope_theta", 10000.0)),
            "rope.fraction": float(rope["partial_rotary_factor"]),
            "rope.scaling": decoder_parts.scaling_from_hf(
                rope, hf, hf["max_position_embeddings"], architecture, partial=True),
            "attention.layer_types": _layer_types(hf, architecture),
            "attention.qkv_bias": bias, "attention.out_bias": bias,
            "linear.heads": hf["linear_num_value_heads"],
            "linear.key_heads": hf["linear_num_key_heads"],
            "linear.key_dim": hf["linear_key_head_dim"],
            "linear.value_dim": hf["linear_value_head_dim"],
            "linear.kernel_size": hf["linear_conv_kernel_dim"]}


def _layer_types(hf: dict, architecture: str) -> tuple[str, ...]:
    """config.json's layer_types (or the full_attention_interval pattern) in tfx terms."""
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        every = hf.get("full_attention_interval", _FULL_EVERY)
        kinds = ["linear_attention" if (i + 1) % every else "full_attention"
                 for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= set(_LAYER_TYPES):
        raise ValueError(f"{architecture}: layer_types must be {layers} of "
                         f"{sorted(_LAYER_TYPES)}, got {kinds}")
    if "linear_attention" not in kinds:
        raise ValueError(f"{architecture}: layer_types has no linear_attention layer; tfx maps "
                         "the hybrid models, which have Gated DeltaNet layers")
    return tuple(_LAYER_TYPES[kind] for kind in kinds)


def shared_experts(hf: dict, architecture: str) -> int:
    """moe.shared_experts: shared_expert_intermediate_size in experts of moe_intermediate_size
    (tfx's shared expert is an MLP of width shared_experts · moe.d_ff)."""
    shared, width = hf["shared_expert_intermediate_size"], hf["moe_intermediate_size"]
    if not (isinstance(shared, int) and isinstance(width, int) and width >= 1
            and shared >= width and shared % width == 0):
        raise ValueError(f"{architecture}: shared_expert_intermediate_size={shared} is not "
                         "supported: tfx's shared expert is a whole number of experts wide, a "
                         f"multiple of moe_intermediate_size={width}")
    return shared // width


def _moe_fields(hf: dict, architecture: str) -> dict:
    """Qwen3-Next's moe.* fields (config.json with defaults filled in)."""
    experts, k = hf["num_experts"], hf["num_experts_per_tok"]
    if not (isinstance(experts, int) and experts >= 1):
        raise ValueError(f"{architecture}: num_experts must be an int >= 1, got {experts}")
    if not (isinstance(k, int) and 1 <= k <= experts):
        raise ValueError(f"{architecture}: num_experts_per_tok must be in [1, num_experts="
                         f"{experts}], got {k}")
    return {"moe.num_experts": experts, "moe.experts_per_token": k,
            "moe.every": hf["decoder_sparse_step"],
            "moe.first_dense": qwen.first_dense(hf, architecture),
            "moe.d_ff": hf["moe_intermediate_size"],
            "moe.shared_experts": shared_experts(hf, architecture),
            "moe.renormalize": bool(hf["norm_topk_prob"]), "moe.jitter": 0.0}


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> Qwen3NextConfig fields; ValueError for what Qwen3-Next cannot
    express."""
    hf = hybrid_to_hf(config, architecture, CARD, "qwen3_next")
    moe = config.moe
    renormalize = moe.experts_per_token > 1 if moe.renormalize is None else moe.renormalize
    return hf | moe_to_hf(config) | {
        "decoder_sparse_step": moe.every, "mlp_only_layers": list(range(moe.first_dense)),
        "norm_topk_prob": renormalize}


def hybrid_to_hf(config: DecoderConfig, architecture: str, card: families.Family,
                 model_type: str) -> dict:
    """The config.json fields of `hybrid_fields`, after checking `config` against `card`."""
    decoder_parts.check_card(config, architecture, card)
    linear = config.linear
    rope = decoder_parts.scaling_to_hf(config, architecture)
    rope["partial_rotary_factor"] = config.rope.fraction
    return {**decoder_parts.common_fields_to_hf(config, architecture, model_type),
            "hidden_act": "silu", "rope_parameters": rope,
            "partial_rotary_factor": config.rope.fraction,
            "attention_bias": decoder_parts.attention_bias(config, architecture, mlp_bias=False),
            "layer_types": [_HF_LAYER_TYPES[config.layer_type(i)]
                            for i in range(config.num_layers)],
            "linear_num_value_heads": linear.heads, "linear_num_key_heads": linear.key_heads,
            "linear_key_head_dim": linear.key_dim, "linear_value_head_dim": linear.value_dim,
            "linear_conv_kernel_dim": linear.kernel_size}


def moe_to_hf(config: DecoderConfig) -> dict:
    """The expert fields that Qwen3-Next and Qwen3.5 MoE share (loss settings: the config
    classes' defaults, as they are training settings in tfx)."""
    moe = config.moe
    width = moe.d_ff or config.d_ff
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": width,
            "shared_expert_intermediate_size": moe.shared_experts * width,
            "output_router_logits": False, "router_aux_loss_coef": 0.001}


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """Qwen3NextForCausalLM tensors -> tfx parameters by state path (every tensor accounted
    for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`)."""
    return hybrid_steps(names, config, fused=True)


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> the tensors save_pretrained writes (one per expert;
    lm_head left out when tied)."""
    return hybrid_tensors(params, config, fused=True)


# --- The tensors of both families ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Packed:
    """HF tensor `name` holding the parameters `targets`: `split` gives them from it, `merge`
    (of the parameters, in order) gives it back."""

    targets: tuple[tuple, ...]
    name: str
    split: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    merge: Callable[..., np.ndarray]


def hybrid_steps(names, config: DecoderConfig, *, fused: bool) -> list[plan.Step]:
    """The plan of a Qwen3-Next (`fused` Gated DeltaNet projections) or Qwen3.5 checkpoint
    holding tensors `names`."""
    out = [plan.Step((path,), (name,), gemma.scale_from_weight) if path[-1] == "scale"
           else plan.copy(path, name, transpose=path[-1] == "kernel")
           for path, name in tensor_names(config).items()]
    out += [plan.Step(packed.targets, (packed.name,), packed.split)
            for packed in _packed(config, fused)]
    for i in _moe_layers(config):
        out += mixtral.moe_steps(names, config, i, f"model.layers.{i}.mlp", _EXPERT_WEIGHTS)
    if config.embeddings.tie and "lm_head.weight" in names:  # a copy: checked, not used
        out.append(plan.tied("lm_head.weight", "model.embed_tokens.weight"))
    return out


def hybrid_tensors(params: dict, config: DecoderConfig, *, fused: bool
                   ) -> dict[str, np.ndarray]:
    """The inverse of `hybrid_steps`: HF tensors by name, experts one tensor each."""
    tensors = {name: gemma.tensor_to_hf(path, np.asarray(params[path]))
               for path, name in tensor_names(config).items()}
    tensors |= {packed.name: packed.merge(*(np.asarray(params[path]) for path in packed.targets))
                for packed in _packed(config, fused)}
    for i in _moe_layers(config):
        tensors |= mixtral.moe_tensors(params, config, i, f"model.layers.{i}.mlp",
                                       _EXPERT_WEIGHTS)
    return tensors


def _moe_layers(config: DecoderConfig) -> list[int]:
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]


def tensor_names(config: DecoderConfig) -> dict[tuple, str]:
    """tfx path -> HF tensor name of every parameter stored as one tensor as it is (kernels
    transposed; `scale`s, the (1 + weight) norms, shifted): all but the packed projections,
    the convolutions and the routed experts."""
    names = {("embeddings", "tokens", "table"): "model.embed_tokens.weight",
             ("stack", "final_norm", "scale"): "model.norm.weight"}
    if not config.embeddings.tie:
        names[("head", "kernel")] = "lm_head.weight"
    bias = decoder_parts.biases(config)["out"]  # attention_bias: q, k, v and o alike
    for i in range(config.num_layers):
        layer, hf = ("stack", "layers", i), f"model.layers.{i}"
        names[(*layer, "attention_norm", "scale")] = f"{hf}.input_layernorm.weight"
        names[(*layer, "mlp_norm", "scale")] = f"{hf}.post_attention_layernorm.weight"
        attention = (*layer, "attention")
        if config.layer_type(i) == "linear":
            for ours, theirs in _LINEAR.items():
                names[(*attention, *ours)] = f"{hf}.linear_attn.{theirs}"
        else:
            for ours, theirs in (("key", "k_proj"), ("value", "v_proj"), ("out", "o_proj")):
                names[(*attention, ours, "kernel")] = f"{hf}.self_attn.{theirs}.weight"
                if bias:
                    names[(*attention, ours, "bias")] = f"{hf}.self_attn.{theirs}.bias"
            for ours, theirs in (("query_norm", "q_norm"), ("key_norm", "k_norm")):
                names[(*attention, ours, "norm", "scale")] = f"{hf}.self_attn.{theirs}.weight"
        if config.is_moe_layer(i):
            for ours, theirs in _MLP.items():
                names[(*layer, "mlp", "shared", ours, "kernel")] = \
                    f"{hf}.mlp.shared_expert.{theirs}.weight"
            names[(*layer, "mlp", "shared_gate", "kernel")] = f"{hf}.mlp.shared_expert_gate.weight"
        else:
            for ours, theirs in _MLP.items():
                names[(*layer, "mlp", ours, "kernel")] = f"{hf}.mlp.{theirs}.weight"
    return names


def packed_kernels(config: DecoderConfig, *, fused: bool
                   ) -> dict[str, tuple[tuple[tuple, ...], Callable[..., np.ndarray]]]:
    """HF weight name -> (the kernels it packs, in order; `merge`: those kernels [d_in, n_j]
    -> the weight [sum n_j, d_in]) of every linear layer holding tfx kernels in its own layout:
    the full layers' q_proj, the linear layers' input projections (`fused`: Qwen3-Next's)."""
    return {packed.name: (packed.targets, packed.merge) for packed in _packed(config, fused)
            if all(path[-1] == "kernel" for path in packed.targets)}


def _packed(config: DecoderConfig, fused: bool) -> list[_Packed]:
    """The tensors each holding several parameters (or one in another layout): the full
    layers' q_proj (queries and output gates, per head), the linear layers' convolution and
    input projections (`fused`: Qwen3-Next's in_proj_qkvz / in_proj_ba)."""
    out = []
    for i in range(config.num_layers):
        attention, hf = ("stack", "layers", i, "attention"), f"model.layers.{i}"
        if config.layer_type(i) == "linear":
            out += _linear_packed(config.linear, attention, f"{hf}.linear_attn", fused)
        else:
            out += _query_gate_packed(config, attention, f"{hf}.self_attn.q_proj")
    return out


def _query_gate_packed(config: DecoderConfig, attention: tuple, q_proj: str) -> list[_Packed]:
    """A full layer's q_proj weight (and bias, with attention_bias): each head's query rows,
    then its gate rows."""
    kinds = ("kernel", "bias") if decoder_parts.biases(config)["query"] else ("kernel",)
    return [_Packed(((*attention, "query", kind), (*attention, "gate", kind)),
                    f"{q_proj}.{'weight' if kind == 'kernel' else 'bias'}",
                    functools.partial(_split_query_gate, config.num_heads, kind == "kernel"),
                    functools.partial(_merge_query_gate, config.num_heads, kind == "kernel"))
            for kind in kinds]


def _linear_packed(linear, attention: tuple, prefix: str, fused: bool) -> list[_Packed]:
    """A Gated DeltaNet layer's convolution and input projections (`linear`: its
    LinearAttentionConfig; `prefix`: its HF module, "model.layers.{i}.linear_attn")."""
    kernels = [(*attention, name, "kernel")
               for name in ("query", "key", "value", "gate", "beta", "decay")]
    out = [_Packed(((*attention, "conv"),), f"{prefix}.conv1d.weight", _conv_from_hf,
                   _conv_to_hf)]
    if fused:  # per key head: its query, key, values and gates; its β and decays
        group = linear.heads // linear.key_heads
        widths = (linear.key_dim, linear.key_dim, group * linear.value_dim,
                  group * linear.value_dim)
        merge = functools.partial(_merge_groups, linear.key_heads)
        out.append(_Packed(tuple(kernels[:4]), f"{prefix}.in_proj_qkvz.weight",
                           functools.partial(_split_groups, linear.key_heads, widths), merge))
        out.append(_Packed(tuple(kernels[4:]), f"{prefix}.in_proj_ba.weight",
                           functools.partial(_split_groups, linear.key_heads, (group, group)),
                           merge))
        return out
    width = linear.key_heads * linear.key_dim
    rows = (width, width, linear.heads * linear.value_dim)
    out.append(_Packed(tuple(kernels[:3]), f"{prefix}.in_proj_qkv.weight",
                       functools.partial(_split_rows, rows), _merge_rows))
    return out + [_Packed((kernel,), f"{prefix}.in_proj_{letter}.weight",
                          functools.partial(_split_rows, (size,)), _merge_rows)
                  for kernel, letter, size in zip(kernels[3:], "zba", (
                      linear.heads * linear.value_dim, linear.heads, linear.heads), strict=True)]


def _split_query_gate(heads: int, transposed: bool, packed: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """q_proj's weight [heads · 2 · head_dim, in] (`transposed`: into kernels [in, ...]) or
    bias [heads · 2 · head_dim], each head's query rows then its gate rows -> query, gate."""
    packed = packed.T if transposed else packed
    per_head = packed.reshape(*packed.shape[:-1], heads, 2, -1)
    return tuple(per_head[..., j, :].reshape(*packed.shape[:-1], -1) for j in (0, 1))


def _merge_query_gate(heads: int, transposed: bool, query: np.ndarray, gate: np.ndarray
                      ) -> np.ndarray:
    """The inverse of `_split_query_gate`."""
    halves = [x.reshape(*x.shape[:-1], heads, 1, -1) for x in (query, gate)]
    packed = np.concatenate(halves, axis=-2).reshape(*query.shape[:-1], -1)
    return packed.T if transposed else packed


def _split_groups(groups: int, widths: tuple[int, ...], weight: np.ndarray
                  ) -> tuple[np.ndarray, ...]:
    """An nn.Linear weight whose rows are [groups, (widths...)] -> one kernel [in, groups ·
    width] per width."""
    per_group = weight.T.reshape(weight.shape[1], groups, sum(widths))
    parts = np.split(per_group, np.cumsum(widths)[:-1], axis=-1)
    return tuple(part.reshape(weight.shape[1], -1) for part in parts)


def _merge_groups(groups: int, *kernels: np.ndarray) -> np.ndarray:
    """The inverse of `_split_groups`."""
    parts = [k.reshape(k.shape[0], groups, -1) for k in kernels]
    return np.concatenate(parts, axis=-1).reshape(kernels[0].shape[0], -1).T


def _split_rows(rows: tuple[int, ...], weight: np.ndarray) -> tuple[np.ndarray, ...]:
    """An nn.Linear weight stacking `rows` outputs each -> their kernels [in, rows]."""
    return tuple(part.T for part in np.split(weight, np.cumsum(rows)[:-1], axis=0))


def _merge_rows(*kernels: np.ndarray) -> np.ndarray:
    return np.concatenate([k.T for k in kernels], axis=0)


def _conv_from_hf(weight: np.ndarray) -> tuple[np.ndarray]:
    """conv1d.weight [channels, 1, taps] (depthwise) -> tfx's conv [taps, channels]."""
    return (weight[:, 0].T,)


def _conv_to_hf(conv: np.ndarray) -> np.ndarray:
    return conv.T[:, None, :]
