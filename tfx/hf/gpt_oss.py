"""GPT-OSS (`GptOssForCausalLM`) checkpoints <-> tfx `Decoder` with a mixture of experts.

GPT-OSS is Mixtral (RMSNorm, grouped-query attention, "half" rotary layout, a sparse MoE block
in every layer; see `tfx.hf.mixtral`) with (its card: `tfx.models.families.GPT_OSS`):

- a learned sink logit per query head, counted in every softmax as a key of value zero
  (attention.sinks): `self_attn.sinks` [H] -> attention/sinks;
- attention_bias: biases on the query, key, value and output projections (attention.qkv_bias
  and out_bias; there is no dense MLP);
- sliding and full layers: layer_types ("sliding_attention" / "full_attention"; when absent,
  sliding, full, sliding, ...) -> attention.layer_types with attention.sliding_window (128 in
  the released models). tfx decodes with one linear KV cache and a window mask per sliding
  layer where transformers keeps sliding-window caches; the tokens are the same;
- YaRN rope (rope_parameters, or the legacy rope_theta / rope_scaling, as in `tfx.hf.llama`;
  rope_theta 150000 when none is named) -> rope.scaling, `truncate` included;
- a router with a bias: the top k of its logits, weighted by a softmax over those k, which is
  the softmax over all experts renormalised over the k (moe.policy "topk", moe.renormalize,
  moe.router_bias): `mlp.router.weight` [E, d] -> mlp/router/kernel [d, E], `.bias` [E] ->
  mlp/router/bias;
- experts with biases and a clamped SwiGLU (moe.expert_bias; swiglu_limit, swiglu_alpha ->
  moe.swiglu_limit, moe.swiglu_alpha: `tfx.ops.moe.ClampedSwiGLU`). Per layer
  `model.layers.{i}.mlp.experts.`: gate_up_proj [E, d, 2f], its columns interleaved gate, up,
  gate, up, ... -> mlp/experts/gate, up [E, d, f] (even and odd columns); gate_up_proj_bias
  [E, 2f] -> gate_bias, up_bias [E, f] likewise; down_proj [E, f, d] -> down (the same
  layout); down_proj_bias [E, d] -> down_bias. save_pretrained writes these in-memory names.

Embeddings, norms and the head are named as in LLaMA. hidden_act is read by no part of
transformers' GPT-OSS (its experts are the clamped SwiGLU), so it is not read, and a save
writes "silu". The load-balancing loss is Mixtral's: `train_settings` gives its weight as
`tfx.hf.mixtral.train_settings` does, and a save writes GptOssConfig's defaults.

Refused (ValueError naming the field): a quantized checkpoint (the released ones ship MXFP4
experts, `quantization_config`: tfx loads float weights), sliding_window None (transformers'
GPT-OSS builds the sliding layers' mask whatever the layer types), layer types other than the
two, partial rotary factors and rope types tfx lacks; on export, configs outside the card (e.g.
no sinks, a router without bias, a capacity) and a model without moe.swiglu_limit.
"""

from __future__ import annotations

import numpy as np

from tfx.hf import decoder_parts, mixtral, plan
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "CARD", "HAS_EXPERTS", "IGNORED", "OPTIONAL_PARAMS",
           "config_from_hf", "config_to_hf", "params_from_hf", "params_to_hf", "steps",
           "tensor_names", "train_settings"]

ARCHITECTURES = ("GptOssForCausalLM",)
HAS_EXPERTS = True  # models with experts, `moe`, may be saved as GPT-OSS (tfx.hf.save)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = decoder_parts.IGNORED  # rotary frequency buffers of older checkpoints
CARD = families.GPT_OSS  # what every GPT-OSS is: set on load, checked on save

# GptOssConfig's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                 num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, sliding_window=128, attention_bias=True,
                 num_local_experts=128, num_experts_per_tok=4, swiglu_alpha=1.702,
                 swiglu_limit=7.0, router_aux_loss_coef=0.001, output_router_logits=False,
                 rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                      beta_slow=1.0, truncate=False,
                                      original_max_position_embeddings=4096))
_DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta, for a config that names no rope_theta
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_HF_LAYER_TYPES = {kind: name for name, kind in _LAYER_TYPES.items()}
_EXPERTS = ("mlp", "experts")


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """GptOssConfig fields (config.json as a dict) -> DecoderConfig with experts; dropout off
    (the loss weights are training settings: `train_settings`)."""
    _check_not_quantized(hf, architecture)
    # GptOssConfig's attribute_map: num_experts is another name of num_local_experts.
    experts = hf.get("num_local_experts", hf.get("num_experts", _DEFAULTS["num_local_experts"]))
    hf = {**_DEFAULTS, **hf}
    if hf["num_key_value_heads"] is None:  # GptOssConfig: None means MHA
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    hf["head_dim"] = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    if hf["sliding_window"] is None:
        raise ValueError(f"{architecture}: sliding_window=None is not supported (transformers' "
                         "GPT-OSS needs a window, used by the 'sliding_attention' layers)")
    k = hf["num_experts_per_tok"]
    if not (isinstance(k, int) and isinstance(experts, int) and 1 <= k <= experts):
        raise ValueError(f"{architecture}: num_experts_per_tok must be in [1, num_local_experts"
                         f"={experts}], got {k}")
    bias = bool(hf["attention_bias"])
    return decoder_parts.from_card(CARD, {
        **decoder_parts.common_fields(hf),
        **decoder_parts.rope_fields(hf, architecture, _DEFAULT_THETA),
        "attention.qkv_bias": bias, "attention.out_bias": bias,
        "attention.sliding_window": hf["sliding_window"],
        "attention.layer_types": _layer_types(hf, architecture),
        "moe.num_experts": experts, "moe.experts_per_token": k,
        "moe.d_ff": hf["intermediate_size"], "moe.swiglu_limit": float(hf["swiglu_limit"]),
        "moe.swiglu_alpha": float(hf["swiglu_alpha"]), "moe.jitter": 0.0})


def _check_not_quantized(hf: dict, architecture: str) -> None:
    """ValueError for a config.json that declares quantized weights (the released GPT-OSS
    checkpoints' MXFP4 experts)."""
    quantization = hf.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(f"{architecture}: quantization_config (quant_method={method!r}) is not "
                         "supported: tfx loads float experts (dequantize the MXFP4 checkpoint "
                         "first, e.g. transformers' Mxfp4Config(dequantize=True) and "
                         "save_pretrained)")


def _layer_types(hf: dict, architecture: str) -> tuple[str, ...]:
    """config.json's layer_types, or GptOssConfig's default (sliding, full, sliding, ...), in
    tfx terms."""
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(layers)]
    unknown = sorted(set(kinds) - set(_LAYER_TYPES))
    if unknown or len(kinds) != layers:
        raise ValueError(f"{architecture}: layer_types must be {layers} of "
                         f"{sorted(_LAYER_TYPES)}, got {kinds}")
    return tuple(_LAYER_TYPES[kind] for kind in kinds)


def train_settings(hf: dict) -> dict:
    """The training settings of a GptOssConfig (config.json as a dict), as
    tfx.train.config.TrainConfig fields: {"load_balancing_weight": router_aux_loss_coef · k,
    or 0 when output_router_logits is false; "router_z_weight": 0.0} (transformers' GPT-OSS
    has Mixtral's loss: `tfx.hf.mixtral.train_settings`)."""
    return mixtral.train_settings({**_DEFAULTS, **hf})


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> GptOssConfig fields; ValueError for what GPT-OSS cannot express."""
    decoder_parts.check_card(config, architecture, CARD)
    moe = config.moe
    if moe.swiglu_limit is None:
        raise ValueError(f"{architecture} needs moe.swiglu_limit (its experts' SwiGLU is "
                         "clamped)")
    if config.attention.sliding_window is None:
        raise ValueError(f"{architecture} needs attention.sliding_window (transformers builds "
                         "the sliding layers' mask whatever the layer types)")
    hf = decoder_parts.common_fields_to_hf(config, architecture, "gpt_oss")
    hf.update(hidden_act="silu",
              rope_parameters=decoder_parts.scaling_to_hf(config, architecture),
              attention_bias=decoder_parts.attention_bias(config, architecture, mlp_bias=False),
              sliding_window=config.attention.sliding_window,
              layer_types=[_HF_LAYER_TYPES[config.layer_type(i)]
                           for i in range(config.num_layers)],
              intermediate_size=moe.d_ff or config.d_ff, num_local_experts=moe.num_experts,
              num_experts_per_tok=moe.experts_per_token, swiglu_limit=moe.swiglu_limit,
              swiglu_alpha=moe.swiglu_alpha, output_router_logits=False,
              router_aux_loss_coef=_DEFAULTS["router_aux_loss_coef"])
    return hf


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """GptOssForCausalLM tensors -> tfx parameters by state path (every tensor accounted
    for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`): the
    tensors copied one to one, and each layer's interleaved gate/up weights and biases split."""
    return [*decoder_parts.steps(names, config, tensor_names(config)),
            *(plan.Step((gate, up), (name,), _deinterleave) for gate, up, name in _fused(config))]


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> the tensors save_pretrained writes (lm_head left out
    when tied)."""
    tensors = decoder_parts.params_to_hf(params, config, tensor_names(config))
    return tensors | {name: _interleave(np.asarray(params[gate]), np.asarray(params[up]))
                      for gate, up, name in _fused(config)}


def tensor_names(config: DecoderConfig) -> dict[tuple, str]:
    """tfx path -> HF tensor name, for every parameter copied one to one: LLaMA's (embeddings,
    head, attention projections with their biases, norms), each layer's sinks, router and down
    projection with its bias. Torch nn.Linear weights are transposed into kernels; the
    experts' stacked tensors are not (their layout is tfx's)."""
    names = decoder_parts.tensor_names(config)
    for i in range(config.num_layers):
        layer, hf = _layer(i), f"model.layers.{i}"
        names[(*layer, "attention", "sinks")] = f"{hf}.self_attn.sinks"
        names[(*layer, "mlp", "router", "kernel")] = f"{hf}.mlp.router.weight"
        names[(*layer, "mlp", "router", "bias")] = f"{hf}.mlp.router.bias"
        names[(*layer, *_EXPERTS, "down")] = f"{hf}.mlp.experts.down_proj"
        names[(*layer, *_EXPERTS, "down_bias")] = f"{hf}.mlp.experts.down_proj_bias"
    return names


def _fused(config: DecoderConfig):
    """(gate path, up path, HF name) of each tensor holding a layer's gate and up columns
    interleaved: its experts' gate_up_proj and gate_up_proj_bias."""
    for i in range(config.num_layers):
        experts, hf = (*_layer(i), *_EXPERTS), f"model.layers.{i}.mlp.experts"
        for suffix in ("", "_bias"):
            yield ((*experts, f"gate{suffix}"), (*experts, f"up{suffix}"),
                   f"{hf}.gate_up_proj{suffix}")


def _layer(i: int) -> tuple:
    return ("stack", "layers", i)


def _deinterleave(gate_up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 2f] with columns gate0, up0, gate1, up1, ... -> gate, up [..., f]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up_proj has an odd last dim {gate_up.shape[-1]}, expected 2f "
                         "(gate and up columns interleaved)")
    return gate_up[..., ::2], gate_up[..., 1::2]


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The inverse of `_deinterleave`: gate, up [..., f] -> [..., 2f]."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
