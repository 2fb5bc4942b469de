"""Mixtral (`MixtralForCausalLM`) checkpoints <-> tfx `Decoder` with a mixture of experts.

Mixtral is Mistral (RMSNorm, grouped-query attention, "half" rotary layout, an optional sliding
window) with a sparse MoE block in place of every MLP: a bias-free router over E experts picks
the k most probable by softmax over all E, weighted by their probabilities renormalised over the
k (tfx's `moe.policy="topk"`, dropless), and each expert is a SwiGLU MLP
(w1 = gate, w3 = up, w2 = down). Attention and norms map as in `tfx.hf.llama`; the card is
`tfx.models.families.MIXTRAL`.

Tensors. `save_pretrained` (transformers 5) writes, and Hub checkpoints hold, one tensor per
expert: `model.layers.{i}.block_sparse_moe.gate.weight` [E, d] and
`model.layers.{i}.block_sparse_moe.experts.{j}.w1|w3.weight` [f, d], `.w2.weight` [d, f].
transformers 5 fuses them in memory as `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2f, d]
(gate first) and `.down_proj` [E, d, f], with the router at `mlp.gate.weight`; both layouts, and
either prefix, are read. `save` writes the per-expert layout. tfx stacks the experts:
`stack/layers/{i}/mlp/router/kernel` [d, E], `mlp/experts/gate|up` [E, d, f],
`mlp/experts/down` [E, f, d].

Training settings. HF adds `router_aux_loss_coef · L` to the loss only when
`output_router_logits` is true, with a load-balancing loss L that scores a balanced router k
(it counts k choices per token as fractions of the tokens); tfx's loss scores it 1. The loss
weights are training settings in tfx (tfx.train.config.TrainConfig), not part of the model:
`train_settings` reads them from a config.json (`router_aux_loss_coef · k`, 0 when
`output_router_logits` is false; no router z-loss), and a save writes MixtralConfig's defaults
(`output_router_logits` false).
`router_jitter_noise` multiplies the whole MoE input (router and experts) in training, tfx's
`moe.jitter` only the router logits: it is not carried either way (0 on load and save);
inference is unaffected by both.
"""

from __future__ import annotations

import functools

import numpy as np

from tfx.hf import decoder_parts, plan
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "HAS_EXPERTS", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf",
           "config_to_hf", "moe_steps", "moe_tensors", "params_from_hf", "params_to_hf", "steps",
           "train_settings"]

ARCHITECTURES = ("MixtralForCausalLM",)
HAS_EXPERTS = True  # models with experts, `moe`, may be saved as Mixtral (tfx.hf.save)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = decoder_parts.IGNORED  # the rotary buffers older transformers saved
CARD = families.MIXTRAL  # what every Mixtral is (tfx.models.families)

# MixtralConfig's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=None, hidden_act="silu", max_position_embeddings=4096 * 32,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                 num_experts_per_tok=2, num_local_experts=8, output_router_logits=False,
                 router_aux_loss_coef=0.001, router_jitter_noise=0.0)
_DEFAULT_THETA = 1e6  # MixtralConfig.default_theta, for a config.json that names no rope_theta
_DEFAULT_AUX_COEF = _DEFAULTS["router_aux_loss_coef"]
_ROUTER = ("mlp", "router", "kernel")
_EXPERTS = ("gate", "up", "down")
_WEIGHTS = ("w1", "w3", "w2")  # Mixtral's names of each expert's gate, up and down weights


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """MixtralConfig fields (config.json as a dict) -> DecoderConfig with experts; dropout off
    (the loss weights are training settings: `train_settings`)."""
    hf = {**_DEFAULTS, **hf}
    if hf.get("num_key_value_heads") is None:  # MixtralConfig: None means MHA
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    experts, k = hf["num_local_experts"], hf["num_experts_per_tok"]
    if not (isinstance(experts, int) and experts >= 1):
        raise ValueError(f"{architecture}: num_local_experts must be an int >= 1, got {experts}")
    if not (isinstance(k, int) and 1 <= k <= experts):
        raise ValueError(f"{architecture}: num_experts_per_tok must be in [1, num_local_experts"
                         f"={experts}], got {k}")
    if k == 1:
        # HF renormalises the one weight to 1; tfx's top-1 (Switch) keeps the probability.
        raise ValueError(f"{architecture}: num_experts_per_tok=1 is not supported (transformers "
                         "weights the single expert by 1, tfx's top-1 router by its probability)")
    decoder_parts.check_silu(hf, architecture)
    return decoder_parts.from_card(CARD, {
        **decoder_parts.common_fields(hf), **decoder_parts.rope_fields(hf, architecture,
                                                                       _DEFAULT_THETA),
        "attention.sliding_window": hf["sliding_window"], "moe.num_experts": experts,
        "moe.experts_per_token": k, "moe.d_ff": hf["intermediate_size"], "moe.jitter": 0.0})


def train_settings(hf: dict) -> dict:
    """The training settings of a MixtralConfig (config.json as a dict), as
    tfx.train.config.TrainConfig fields: {"load_balancing_weight": router_aux_loss_coef · k,
    or 0 when output_router_logits is false; "router_z_weight": 0.0}."""
    hf = {**_DEFAULTS, **hf}
    k = hf["num_experts_per_tok"]
    balance = float(hf["router_aux_loss_coef"]) * k if hf["output_router_logits"] else 0.0
    return {"load_balancing_weight": balance, "router_z_weight": 0.0}


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> MixtralConfig fields; ValueError for what Mixtral cannot express."""
    if isinstance(config, DecoderConfig) and config.moe is None:
        raise ValueError(f"{architecture} needs experts, moe (a dense model saves as "
                         "LlamaForCausalLM or MistralForCausalLM)")
    decoder_parts.check_card(config, architecture, CARD)
    if config.moe.renormalize is False:
        raise ValueError(f"{architecture} cannot express moe.renormalize=False (it divides the "
                         "k weights by their sum)")
    if config.moe.experts_per_token == 1:
        raise ValueError(f"{architecture} cannot express moe.experts_per_token=1 (it weights a "
                         "single expert by 1, tfx by its probability)")
    hf = {**decoder_parts.common_fields_to_hf(config, architecture, "mixtral"),
          "hidden_act": "silu", "rope_parameters": decoder_parts.scaling_to_hf(config,
                                                                               architecture)}
    # MixtralConfig keeps head_dim None (d_model // heads) where LlamaConfig fills it in.
    hf.update(head_dim=config.attention.head_dim, intermediate_size=_expert_width(config),
              sliding_window=config.attention.sliding_window,
              num_local_experts=config.moe.num_experts,
              num_experts_per_tok=config.moe.experts_per_token, output_router_logits=False,
              router_aux_loss_coef=_DEFAULT_AUX_COEF, router_jitter_noise=0.0)
    return hf


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """MixtralForCausalLM tensors (per-expert or fused layout) -> tfx parameters by state path
    (every tensor accounted for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`)."""
    out = decoder_parts.steps(names, config)  # all but the MoE blocks
    for i in range(config.num_layers):
        out += moe_steps(names, config, i, _block(names, i))
    return out


def moe_steps(names, config: DecoderConfig, layer: int, block: str,
              weights: tuple[str, str, str] = _WEIGHTS) -> list[plan.Step]:
    """The steps making layer `layer`'s router and stacked experts from the tensors under
    `block` (e.g. "model.layers.0.mlp"): the router `{block}.gate.weight` [E, d], and the
    experts fused (`{block}.experts.gate_up_proj`, `.down_proj`) or one tensor per expert
    (`{block}.experts.{j}.{w}.weight` for w in `weights`, the names of the gate, up and down
    weights: Mixtral's w1, w3, w2; Qwen 3 MoE's gate_proj, up_proj, down_proj)."""
    path = ("stack", "layers", layer)
    targets = tuple((*path, "mlp", "experts", name) for name in _EXPERTS)
    return [plan.copy((*path, *_ROUTER), f"{block}.gate.weight", transpose=True),
            *_expert_steps(names, block, targets, config.moe.num_experts, weights)]


def moe_tensors(params: dict, config: DecoderConfig, layer: int, block: str,
                weights: tuple[str, str, str] = _WEIGHTS) -> dict[str, np.ndarray]:
    """The inverse of `moe_steps`: layer `layer`'s router and per-expert tensors, as
    save_pretrained writes them."""
    path = ("stack", "layers", layer)
    tensors = {f"{block}.gate.weight": np.asarray(params[(*path, *_ROUTER)]).T}
    for name, hf_name in zip(_EXPERTS, weights, strict=True):
        stacked = np.asarray(params[(*path, "mlp", "experts", name)])
        for j in range(config.moe.num_experts):
            # nn.Linear weights are [out, in]: gate, up [f, d] and down [d, f].
            tensors[f"{block}.experts.{j}.{hf_name}.weight"] = stacked[j].T
    return tensors


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> the per-expert tensors that save_pretrained writes
    (lm_head left out when tied)."""
    tensors = decoder_parts.params_to_hf(params, config)  # all but the MoE blocks
    for i in range(config.num_layers):
        tensors |= moe_tensors(params, config, i, f"model.layers.{i}.block_sparse_moe")
    return tensors


def _expert_width(config: DecoderConfig) -> int:
    return config.d_ff if config.moe.d_ff is None else config.moe.d_ff


def _block(names, layer: int) -> str:
    """Prefix of layer `layer`'s MoE tensors: `block_sparse_moe` (saved) or `mlp` (fused); the
    saved one when the checkpoint has neither (the missing tensors are then named so)."""
    fused = f"model.layers.{layer}.mlp"
    return fused if f"{fused}.gate.weight" in names else f"model.layers.{layer}.block_sparse_moe"


def _expert_steps(names, block: str, targets: tuple, num_experts: int,
                  weights: tuple[str, str, str]) -> list[plan.Step]:
    """Steps making the stacked experts `targets` (gate [E, d, f], up [E, d, f], down
    [E, f, d]) from either tensor layout."""
    fused = f"{block}.experts.gate_up_proj"
    if fused in names:
        sources = (fused, f"{block}.experts.down_proj")
        return [plan.Step(targets, sources, functools.partial(_split_fused, fused))]
    # nn.Linear weights are [out, in]: gate, up [f, d] and down [d, f], one tensor per expert.
    return [plan.Step((target,), tuple(f"{block}.experts.{j}.{w}.weight"
                                       for j in range(num_experts)), _stack_transposed)
            for target, w in zip(targets, weights, strict=True)]


def _stack_transposed(*weights: np.ndarray) -> tuple[np.ndarray]:
    return (np.stack([w.T for w in weights]),)


def _split_fused(name: str, gate_up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, ...]:
    """gate_up [E, 2f, d] (gate rows first), down [E, d, f] -> gate, up [E, d, f], down
    [E, f, d]."""
    if gate_up.ndim != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"tensor {name!r} has shape {gate_up.shape}, expected [E, 2f, d]")
    f = gate_up.shape[1] // 2
    return (gate_up[:, :f].transpose(0, 2, 1), gate_up[:, f:].transpose(0, 2, 1),
            down.transpose(0, 2, 1))
