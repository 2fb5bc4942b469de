"""Qwen 2 / 2.5 (`Qwen2ForCausalLM`), Qwen 3 (`Qwen3ForCausalLM`) and Qwen 3 MoE
(`Qwen3MoeForCausalLM`) checkpoints <-> tfx `Decoder`.

All three are LLaMA-style decoders and map as `tfx.hf.llama` does (RMSNorm, SwiGLU MLP,
grouped-query attention, the "half" rotary layout, rope_parameters or the legacy rope fields,
torch [out, in] weights transposed into nnx kernels, lm_head tied to the embeddings with
tie_word_embeddings), with:

- Qwen 2: biases on the query, key and value projections only (none on o_proj or the MLP) ->
  use_bias=False, attention.qkv_bias=True. Its config class has no head_dim (hidden_size //
  num_attention_heads), but transformers reads one that a config.json gives: so does tfx.
- Qwen 3: q_norm / k_norm, an RMSNorm over each head's head_dim features with one weight
  [head_dim] shared by the heads, before the rotation -> attention.qk_norm="per_head"
  (stack/layers/i/attention/query_norm/norm/scale, key_norm); head_dim is a field of its own
  (default 128, independent of hidden_size / heads); attention_bias puts biases on q, k, v and
  o but not the MLP -> attention.qkv_bias = attention.out_bias = True, use_bias=False.
- Qwen 3 MoE: Qwen 3's attention (head_dim as in Qwen 2), and a sparse MoE block in place of
  the MLP of layer i when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
  (moe.every = decoder_sparse_step; mlp_only_layers as leading dense layers, moe.first_dense:
  a list that keeps other layers dense is refused). Its router `mlp.gate.weight` [E, d]
  (-> stack/layers/i/mlp/router/kernel) picks the top num_experts_per_tok of a softmax over
  all E experts (policy "topk", dropless), weighted by their probabilities, renormalised over
  the k when norm_topk_prob (-> moe.renormalize); experts are SwiGLU MLPs of width
  moe_intermediate_size (-> moe.d_ff), the dense layers' width is intermediate_size (-> d_ff).
  save_pretrained (transformers 5) writes one tensor per expert,
  `mlp.experts.{j}.gate_proj|up_proj|down_proj.weight`, and fuses them in memory as
  `mlp.experts.gate_up_proj` [E, 2f, d] / `down_proj` [E, d, f]: both layouts are read (the
  helpers of `tfx.hf.mixtral`), the per-expert one is written. The expert count is
  config.json's num_experts (Hub checkpoints) or num_local_experts (what transformers 5
  writes, the attribute the config class maps num_experts to; it wins when both are given).

Sliding windows: transformers sets sliding_window only when use_sliding_window is true.
Qwen 2 and 3 have per-layer layer_types ("full_attention" / "sliding_attention"); without
them, layer i slides when a window is set and i >= max_window_layers. Mixed kinds map to
attention.layer_types with attention.sliding_window; all sliding to the window alone (every
layer then slides), all full to no window. Qwen 3 MoE slides in every layer when a window is
set. A save writes layer_types, use_sliding_window, sliding_window and a max_window_layers
that agrees with them.

Training settings: `router_aux_loss_coef` and `output_router_logits` weigh the same
load-balancing loss as Mixtral's (it scores a balanced router k): `train_settings` gives the
tfx.train.config.TrainConfig weights as `tfx.hf.mixtral.train_settings` does; a save writes
the config class's defaults.

Refused (ValueError naming the field): another hidden_act, rope types tfx lacks and partial
rotary factors (`tfx.hf.llama`), layer types other than full / sliding, sliding layers without
a window, Qwen 3 MoE without any layer with experts or with mlp_only_layers beyond a prefix;
on save, what the architecture lacks (biases elsewhere, other norms, soft-capping, per-layer
windows on Qwen 3 MoE, routers other than softmax top-k, capacity limits, shared experts).
"""

from __future__ import annotations

import numpy as np

from tfx.hf import decoder_parts, mixtral, plan
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "CARDS", "HAS_EXPERTS", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf",
           "config_to_hf", "params_from_hf", "params_to_hf", "steps", "train_settings"]

QWEN2, QWEN3, QWEN3_MOE = "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
ARCHITECTURES = (QWEN2, QWEN3, QWEN3_MOE)
HAS_EXPERTS = True  # Qwen3MoeForCausalLM's models have experts, `moe` (tfx.hf.save)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = decoder_parts.IGNORED  # the rotary buffers older transformers saved
# What every model of each architecture is (tfx.models.families): set on load, checked on save.
CARDS = {QWEN2: families.QWEN2, QWEN3: families.QWEN3, QWEN3_MOE: families.QWEN3_MOE}

_MODEL_TYPES = {QWEN2: "qwen2", QWEN3: "qwen3", QWEN3_MOE: "qwen3_moe"}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_WEIGHTS = ("gate_proj", "up_proj", "down_proj")  # each expert's gate, up and down weights
# The config classes' defaults, for config.json files that leave a field out.
_COMMON = dict(vocab_size=151936, hidden_act="silu", max_position_embeddings=32768,
               rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=None,
               use_sliding_window=False, sliding_window=4096, attention_bias=False)
_DEFAULTS = {
    QWEN2: dict(_COMMON, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_window_layers=28),
    QWEN3: dict(_COMMON, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                max_window_layers=28),
    QWEN3_MOE: dict(_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                    num_attention_heads=32, num_key_value_heads=4, decoder_sparse_step=1,
                    moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
                    norm_topk_prob=False, mlp_only_layers=None, output_router_logits=False,
                    router_aux_loss_coef=0.001),
}


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """Qwen2Config / Qwen3Config / Qwen3MoeConfig fields (config.json as a dict) ->
    DecoderConfig; dropout off (the MoE loss weights are training settings:
    `train_settings`)."""
    hf = {**_DEFAULTS[architecture], **hf}
    if hf["num_key_value_heads"] is None:  # the config classes: None means MHA
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    window, layer_types = _windows(hf, architecture)
    decoder_parts.check_silu(hf, architecture)
    fields = {**decoder_parts.common_fields(hf), **decoder_parts.rope_fields(hf, architecture),
              "attention.sliding_window": window, "attention.layer_types": layer_types}
    if architecture != QWEN2:  # attention_bias: q, k, v and o alike, never the MLP (Qwen 2's
        bias = bool(hf["attention_bias"])  # q, k and v biases are on its card)
        fields |= {"attention.qkv_bias": bias, "attention.out_bias": bias}
    if architecture == QWEN3_MOE:
        fields |= _moe_fields(hf, architecture)
    return decoder_parts.from_card(CARDS[architecture], fields)


def _windows(hf: dict, architecture: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(attention.sliding_window, attention.layer_types) of a config with defaults filled in:
    no window when no layer slides, no layer types when every layer is alike."""
    window = hf["sliding_window"] if hf["use_sliding_window"] else None  # as transformers
    layers = hf["num_hidden_layers"]
    if architecture == QWEN3_MOE:  # one window for every layer
        return window, None
    kinds = hf.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if window is not None and i >= hf["max_window_layers"]
                 else "full_attention" for i in range(layers)]
    unknown = sorted(set(kinds) - set(_LAYER_TYPES))
    if unknown or len(kinds) != layers:
        raise ValueError(f"{architecture}: layer_types must be {layers} of "
                         f"{sorted(_LAYER_TYPES)}, got {kinds}")
    types = tuple(_LAYER_TYPES[kind] for kind in kinds)
    if "sliding" not in types:
        return None, None
    if window is None:
        raise ValueError(f"{architecture}: layer_types has sliding_attention layers but no "
                         f"window (use_sliding_window={hf['use_sliding_window']}, "
                         f"sliding_window={hf['sliding_window']})")
    return window, (None if "full" not in types else types)


def _moe_fields(hf: dict, architecture: str) -> dict:
    """The moe.* fields of a Qwen3MoeConfig with defaults filled in."""
    experts = hf.get("num_local_experts", hf["num_experts"])  # the attribute_map's name wins
    k, step = hf["num_experts_per_tok"], hf["decoder_sparse_step"]
    if not (isinstance(experts, int) and experts >= 1):
        raise ValueError(f"{architecture}: num_experts must be an int >= 1, got {experts} (a "
                         "model without experts is a Qwen3ForCausalLM)")
    if not (isinstance(k, int) and 1 <= k <= experts):
        raise ValueError(f"{architecture}: num_experts_per_tok must be in [1, num_experts="
                         f"{experts}], got {k}")
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"{architecture}: decoder_sparse_step must be an int >= 1, got {step}")
    return {"moe.num_experts": experts, "moe.experts_per_token": k, "moe.every": step,
            "moe.first_dense": first_dense(hf, architecture),
            "moe.d_ff": hf["moe_intermediate_size"],
            "moe.renormalize": bool(hf["norm_topk_prob"]), "moe.jitter": 0.0}


def first_dense(hf: dict, architecture: str) -> int:
    """moe.first_dense: the fewest leading layers that, kept dense with every
    decoder_sparse_step-th layer having experts, leave the very layers transformers gives
    experts (those not in mlp_only_layers); Qwen 3 MoE's and Qwen3-Next's rule."""
    step, dense = hf["decoder_sparse_step"], set(hf["mlp_only_layers"] or ())
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"{architecture}: decoder_sparse_step must be an int >= 1, got {step}")
    layers = range(hf["num_hidden_layers"])
    sparse = [i for i in layers if i not in dense and (i + 1) % step == 0]
    if not sparse:
        raise ValueError(f"{architecture}: no layer has experts (decoder_sparse_step={step}, "
                         f"mlp_only_layers={hf['mlp_only_layers']})")
    first = max(0, sparse[0] - step + 1)
    if sparse != [i for i in layers if i >= first and (i + 1) % step == 0]:
        raise ValueError(f"{architecture}: mlp_only_layers={hf['mlp_only_layers']} is not "
                         "supported: tfx keeps leading layers dense (moe.first_dense), then "
                         f"gives every decoder_sparse_step-th ({step}) layer experts")
    return first


def train_settings(hf: dict) -> dict:
    """The training settings of a Qwen3MoeConfig (config.json as a dict), as
    tfx.train.config.TrainConfig fields: {"load_balancing_weight": router_aux_loss_coef · k,
    or 0 when output_router_logits is false; "router_z_weight": 0.0} (see
    `tfx.hf.mixtral.train_settings`: the same loss)."""
    return mixtral.train_settings({**_DEFAULTS[QWEN3_MOE], **hf})


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> Qwen2Config / Qwen3Config / Qwen3MoeConfig fields; ValueError for what
    the architecture cannot express."""
    if architecture == QWEN3_MOE and config.moe is None:
        raise ValueError(f"{architecture} needs experts, moe (a dense model saves as "
                         f"{QWEN3})")
    if architecture != QWEN3_MOE and config.moe is not None:
        raise ValueError(f"{architecture} cannot express num_experts={config.moe.num_experts} "
                         f"(a model with experts saves as {QWEN3_MOE})")
    decoder_parts.check_card(config, architecture, CARDS[architecture])
    hf = {**decoder_parts.common_fields_to_hf(config, architecture, _MODEL_TYPES[architecture]),
          "hidden_act": "silu",
          "rope_parameters": decoder_parts.scaling_to_hf(config, architecture)}
    if architecture != QWEN2:  # Qwen 2's biases (q, k and v) are on its card
        hf["attention_bias"] = decoder_parts.attention_bias(config, architecture, mlp_bias=False)
    hf |= _windows_to_hf(config, architecture)
    if architecture != QWEN3:  # their config classes have no head_dim field: write one only
        hf["head_dim"] = config.attention.head_dim  # when it is not hidden_size // heads
        if hf["head_dim"] is None:
            del hf["head_dim"]
    if architecture == QWEN3_MOE:
        hf |= _moe_to_hf(config, architecture)
    return hf


def _windows_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """use_sliding_window, sliding_window and (Qwen 2 / 3) layer_types, max_window_layers."""
    types = [config.layer_type(i) for i in range(config.num_layers)]
    sliding = "sliding" in types
    hf = {"use_sliding_window": sliding,
          "sliding_window": config.attention.sliding_window if sliding else None}
    if architecture == QWEN3_MOE:
        if sliding and "full" in types:
            raise ValueError(f"{architecture} cannot express attention.layer_types="
                             f"{config.attention.layer_types} (its window, when set, is on "
                             "every layer)")
        return hf
    names = {kind: name for name, kind in _LAYER_TYPES.items()}
    # transformers derives layer_types from max_window_layers only when they are absent.
    return hf | {"layer_types": [names[kind] for kind in types],
                 "max_window_layers": types.index("sliding") if sliding else len(types)}


def _moe_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """The MoE fields of a Qwen3MoeConfig (loss weights: the config class's defaults)."""
    moe = config.moe
    renormalize = moe.experts_per_token > 1 if moe.renormalize is None else moe.renormalize
    defaults = _DEFAULTS[QWEN3_MOE]
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
            "decoder_sparse_step": moe.every, "mlp_only_layers": list(range(moe.first_dense)),
            "moe_intermediate_size": moe.d_ff or config.d_ff, "norm_topk_prob": renormalize,
            "output_router_logits": False,
            "router_aux_loss_coef": defaults["router_aux_loss_coef"]}


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """Qwen2ForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM tensors -> tfx parameters by
    state path (every tensor accounted for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`)."""
    out = decoder_parts.steps(names, config)  # all but the MoE blocks
    for i in _moe_layers(config):
        out += mixtral.moe_steps(names, config, i, f"model.layers.{i}.mlp", _WEIGHTS)
    return out


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> HF tensors, one per expert as save_pretrained writes
    them (lm_head left out when tied)."""
    tensors = decoder_parts.params_to_hf(params, config)  # all but the MoE blocks
    for i in _moe_layers(config):
        tensors |= mixtral.moe_tensors(params, config, i, f"model.layers.{i}.mlp", _WEIGHTS)
    return tensors


def _moe_layers(config: DecoderConfig) -> list[int]:
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]
