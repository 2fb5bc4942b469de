"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) checkpoints <-> tfx `Decoder` with latent attention and
a mixture of experts.

A pre-norm decoder with RMSNorm (input_layernorm -> attention_norm, post_attention_layernorm ->
mlp_norm, model.norm -> stack/final_norm), untied head by default (tie_word_embeddings), no
biases, and:

- Multi-head latent attention in every layer (`DecoderConfig.latent`, tfx.nn.LatentAttention;
  q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim keep their names):
  `self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj` (or `q_proj` when q_lora_rank is null),
  `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj` -> stack/layers/i/attention/
  q_a, q_a_norm, q_b (or query), kv_a, kv_a_norm, kv_b, out. torch [out, in] weights are
  transposed into nnx kernels [in, out]; no permutation is needed, whatever the rotary layout.
  Only the qk_rope_head_dim features rotate: rope_interleave true -> rope.layout
  "interleaved" (transformers rotates DeepSeek's pairs and writes them de-interleaved, for q and
  k alike, so the scores are the same), false -> "half". Scores are scaled by
  (qk_nope_head_dim + qk_rope_head_dim)**-0.5, times mscale² when the rope is scaled with
  mscale_all_dim (transformers' yarn_apply_mscale: mscale = 0.1 · mscale_all_dim · ln(factor)
  + 1) -> attention.scale. The cache (`Decoder.init_cache`) holds the latent and the rotated
  key only, (kv_lora_rank + qk_rope_head_dim) values per token and layer.
- RoPE settings as in `tfx.hf.llama` (rope_parameters, or the legacy rope_theta /
  rope_scaling), YaRN included (DeepSeek-V3's factor 40, mscale = mscale_all_dim = 1).
- Dense first layers: the first first_k_dense_replace layers (moe.first_dense) keep a SwiGLU
  MLP of width intermediate_size (d_ff; mlp.gate_proj, up_proj, down_proj -> mlp/gate, up,
  down). The others have a DeepseekV3MoE:
  * router `mlp.gate.weight` [E, d] -> mlp/router/kernel: sigmoid scores, experts chosen by
    score + `mlp.gate.e_score_correction_bias` (-> mlp/selection_bias, moe.policy
    "deepseek"), among the topk_group best of n_group groups (moe.groups_per_token,
    moe.num_groups); weights are the chosen scores, renormalised when norm_topk_prob
    (moe.renormalize), times routed_scaling_factor (moe.routed_scale). The bias, a buffer in
    transformers, is a Param in tfx that tfx.train moves toward balance (not by gradients);
    loading sets it, saving writes it, and in eval mode tfx routes as transformers does.
  * n_routed_experts (moe.num_experts) SwiGLU experts of width moe_intermediate_size
    (moe.d_ff), num_experts_per_tok of them per token (moe.experts_per_token, dropless).
    save_pretrained (transformers 5) writes one tensor per expert,
    `mlp.experts.{j}.gate_proj|up_proj|down_proj.weight`; transformers fuses them in memory as
    `mlp.experts.gate_up_proj` [E, 2f, d] / `down_proj` [E, d, f]. Both are read (the helpers
    of `tfx.hf.mixtral`), the per-expert layout is written; tfx stacks them at
    mlp/experts/gate, up [E, d, f] and down [E, f, d].
  * n_shared_experts always-active experts, one SwiGLU MLP of width n_shared_experts ·
    moe_intermediate_size (`mlp.shared_experts.gate_proj|up_proj|down_proj` ->
    mlp/shared/gate, up, down; moe.shared_experts).
  transformers keeps the router weight and the bias in float32 (`_keep_in_fp32_modules`); a
  model loaded with dtype="bfloat16" stores its router kernel in bfloat16 (the selection bias
  stays float32, and routing computes in float32).

Left out: the multi-token prediction modules (num_nextn_predict_layers). transformers builds
none and save_pretrained writes none; it ignores a checkpoint's `model.layers.61.*` (the MTP
layer of the published 61-layer checkpoints), and so does tfx; MTP tensors at any other index
are unexpected to both. A save writes num_nextn_predict_layers 0. transformers has no
auxiliary loss for DeepSeek-V3, so there are no training settings to read.

Refused (ValueError naming the field): attention_bias (its biases on q_a, kv_a and o_proj but
not the MLP are not a tfx setting), num_key_value_heads other than num_attention_heads
(transformers repeats the per-head keys by their ratio), rms_norm_eps other than 1e-6
(transformers' q_a/kv_a layernorms always use 1e-6, tfx one epsilon), no shared expert, a
non-integer routing field, another hidden_act, rope types tfx lacks and partial rotary
factors (`tfx.hf.llama`), mscale_all_dim with a rope type other than YaRN; on save, a model
without latent attention or experts, or with what the architecture lacks (other norms,
biases, windows, soft-capping, routers other than "deepseek", capacity limits, experts on
every moe.every-th layer only, a softmax scale other than the one above).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tfx.hf import decoder_parts, mixtral, plan
from tfx.models import families
from tfx.models.config import DecoderConfig, LatentConfig
from tfx.ops.positional import YaRNScaling

__all__ = ["ARCHITECTURES", "HAS_EXPERTS", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf",
           "config_to_hf", "params_from_hf", "params_to_hf", "steps", "tensor_names"]

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
HAS_EXPERTS = True  # its models have experts, `moe` (tfx.hf.save)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
# transformers' _keys_to_ignore_on_load_unexpected: the MTP layer of the 61-layer checkpoints
# (a 62nd real layer is still read: only tensors the model has no place for are ignored).
IGNORED = (*decoder_parts.IGNORED, r"model\.layers\.61\..*")
CARD = families.DEEPSEEK_V3  # what every DeepSeek-V3 is: set on load, checked on save

_LAYOUTS = {True: "interleaved", False: "half"}  # rope_interleave -> rope.layout
_LATENT_FIELDS = tuple(field.name for field in dataclasses.fields(LatentConfig))
# Layer i's attention submodules -> DeepseekV3Attention's, with and without q_lora_rank.
_KV = {"kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj",
       "out": "o_proj"}
_ATTENTION = {True: {"q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj", **_KV},
              False: {"query": "q_proj", **_KV}}
_WEIGHTS = ("gate_proj", "up_proj", "down_proj")  # each expert's gate, up and down weights
# DeepseekV3Config's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_interleave=True, attention_bias=False,
    head_dim=None)  # written by transformers (= qk_rope_head_dim), not read: `latent` sizes heads
_DEFAULT_THETA = 10000.0  # the rope_theta of a config that names none
# The routing fields transformers needs as integers, and their least values.
_ROUTING_FIELDS = {"n_routed_experts": 1, "num_experts_per_tok": 1, "n_group": 1,
                   "topk_group": 1, "first_k_dense_replace": 0, "n_shared_experts": 1}


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """DeepseekV3Config fields (config.json as a dict) -> DecoderConfig with latent attention
    and experts; dropout off."""
    hf = {**_DEFAULTS, **hf}
    if hf.get("num_local_experts") is not None:  # the attribute_map's name wins, as in HF
        hf["n_routed_experts"] = hf["num_local_experts"]
    if hf["num_key_value_heads"] is None:  # DeepseekV3Config: None means num_attention_heads
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    _check_supported(hf, architecture)
    rope = decoder_parts.rope_parameters(hf)
    sizes = {name: value for name, value in decoder_parts.common_fields(hf).items()
             if name not in ("attention.num_kv_heads", "attention.head_dim", "norm.eps")}
    config = decoder_parts.from_card(CARD, {
        **sizes, **{f"latent.{name}": hf[name] for name in _LATENT_FIELDS},
        "rope.theta": float(rope.get("rope_theta", _DEFAULT_THETA)),
        "rope.scaling": decoder_parts.scaling_from_hf(
            rope, hf, hf["max_position_embeddings"], architecture),
        "rope.layout": _LAYOUTS[bool(hf["rope_interleave"])], **_moe_fields(hf)})
    return config.replace(attention={"scale": _scale(config)})


def _check_supported(hf: dict, architecture: str) -> None:
    """ValueError for the settings of `hf` (defaults filled in) that tfx does not map."""
    if hf["hidden_act"] != "silu":
        raise ValueError(f"{architecture}: hidden_act={hf['hidden_act']!r} is not supported "
                         "(tfx maps the gated 'silu' MLP)")
    if hf["attention_bias"]:
        raise ValueError(f"{architecture}: attention_bias=True is not supported (biases on "
                         "q_a_proj, kv_a_proj_with_mqa and o_proj but not the MLP)")
    if hf["num_key_value_heads"] != hf["num_attention_heads"]:
        raise ValueError(f"{architecture}: num_key_value_heads={hf['num_key_value_heads']} is "
                         f"not supported: latent attention has keys and values per head, so it "
                         f"must equal num_attention_heads={hf['num_attention_heads']}")
    if hf["rms_norm_eps"] != 1e-6:
        raise ValueError(f"{architecture}: rms_norm_eps={hf['rms_norm_eps']} is not supported: "
                         "transformers' q_a_layernorm and kv_a_layernorm use 1e-6 whatever it "
                         "says, tfx one epsilon for every norm (1e-6)")
    for name, least in _ROUTING_FIELDS.items():
        value = hf[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{architecture}: {name} must be an int >= {least}, got {value!r}"
                             + (" (tfx has no zero-width shared expert)"
                                if name == "n_shared_experts" else ""))
    rope = decoder_parts.rope_parameters(hf)
    if rope["rope_type"] not in ("default", "yarn") and rope.get("mscale_all_dim"):
        raise ValueError(f"{architecture}: mscale_all_dim with rope_type={rope['rope_type']!r} "
                         "is not supported (tfx keeps it with YaRN only)")


def _moe_fields(hf: dict) -> dict:
    """The moe.* fields of a DeepseekV3Config with defaults filled in."""
    return {"moe.num_experts": hf["n_routed_experts"],
            "moe.experts_per_token": hf["num_experts_per_tok"],
            "moe.d_ff": hf["moe_intermediate_size"], "moe.shared_experts": hf["n_shared_experts"],
            "moe.first_dense": hf["first_k_dense_replace"], "moe.num_groups": hf["n_group"],
            "moe.groups_per_token": hf["topk_group"],
            "moe.renormalize": bool(hf["norm_topk_prob"]),
            "moe.routed_scale": float(hf["routed_scaling_factor"]), "moe.jitter": 0.0}


def _scale(config: DecoderConfig) -> float | None:
    """attention.scale: None for latent attention's default (qk_nope_head_dim +
    qk_rope_head_dim)**-0.5, or that times mscale² under YaRN with mscale_all_dim (transformers'
    yarn_apply_mscale)."""
    scaling = config.rope.scaling
    if not isinstance(scaling, YaRNScaling) or not scaling.mscale_all_dim or scaling.factor <= 1:
        return None
    mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
    return _default_scale(config) * mscale * mscale


def _default_scale(config: DecoderConfig) -> float:
    return (config.latent.qk_nope_head_dim + config.latent.qk_rope_head_dim) ** -0.5


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> DeepseekV3Config fields; ValueError for what DeepSeek-V3 cannot
    express."""
    decoder_parts.check_card(config, architecture, CARD)
    if config.moe.shared_experts < 1:
        raise ValueError(f"{architecture} cannot express moe.shared_experts=0 (it has at least "
                         "one shared expert)")
    default = _default_scale(config)
    scale, expected = config.attention.scale or default, _scale(config) or default
    if not math.isclose(scale, expected, rel_tol=1e-9):
        raise ValueError(f"{architecture} cannot express attention.scale={scale} (its scale "
                         f"follows from the head sizes and YaRN's mscale_all_dim: {expected})")
    latent = config.latent
    hf = decoder_parts.common_fields_to_hf(config, architecture, "deepseek_v3")
    hf.update(dataclasses.asdict(latent), head_dim=latent.qk_rope_head_dim, hidden_act="silu",
              rope_interleave=config.rope.layout == "interleaved", attention_bias=False,
              rope_parameters=decoder_parts.scaling_to_hf(config, architecture),
              num_nextn_predict_layers=0, **_moe_to_hf(config))
    return hf


def _moe_to_hf(config: DecoderConfig) -> dict:
    """The MoE fields of a DeepseekV3Config."""
    moe = config.moe
    renormalize = moe.experts_per_token > 1 if moe.renormalize is None else moe.renormalize
    return {"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.d_ff or config.d_ff,
            "n_shared_experts": moe.shared_experts, "first_k_dense_replace": moe.first_dense,
            "n_group": moe.num_groups, "topk_group": moe.groups_per_token,
            "norm_topk_prob": renormalize, "routed_scaling_factor": moe.routed_scale}


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """DeepseekV3ForCausalLM tensors (per-expert or fused layout) -> tfx parameters by state
    path (every tensor accounted for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`)."""
    out = decoder_parts.steps(names, config, tensor_names(config))  # all but routers and experts
    for i in _moe_layers(config):
        out += mixtral.moe_steps(names, config, i, f"model.layers.{i}.mlp", _WEIGHTS)
    return out


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> HF tensors, one per expert as save_pretrained writes
    them (lm_head left out when tied)."""
    # All but the routers and experts.
    tensors = decoder_parts.params_to_hf(params, config, tensor_names(config))
    for i in _moe_layers(config):
        tensors |= mixtral.moe_tensors(params, config, i, f"model.layers.{i}.mlp", _WEIGHTS)
    return tensors


def tensor_names(config: DecoderConfig) -> dict[tuple, str]:
    """tfx path -> HF tensor name, for every parameter but the routers and routed experts
    (`tfx.hf.mixtral.moe_steps`): `tfx.hf.llama`'s embeddings, head, norms and dense MLPs,
    latent attention, and the MoE layers' shared experts and selection bias."""
    names = {path: name for path, name in decoder_parts.tensor_names(config).items()
             if path[3:4] != ("attention",)}  # LLaMA's q/k/v/o: latent attention has its own
    modules = _ATTENTION[config.latent.q_lora_rank is not None]
    for i in range(config.num_layers):
        layer, hf = ("stack", "layers", i), f"model.layers.{i}"
        for ours, theirs in modules.items():
            kind = "scale" if ours.endswith("_norm") else "kernel"
            names[(*layer, "attention", ours, kind)] = f"{hf}.self_attn.{theirs}.weight"
        if config.is_moe_layer(i):
            names[(*layer, "mlp", "selection_bias")] = f"{hf}.mlp.gate.e_score_correction_bias"
            for ours, theirs in zip(("gate", "up", "down"), _WEIGHTS, strict=True):
                names[(*layer, "mlp", "shared", ours, "kernel")] = \
                    f"{hf}.mlp.shared_experts.{theirs}.weight"
    return names


def _moe_layers(config: DecoderConfig) -> list[int]:
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]
