"""GPT-NeoX (`GPTNeoXForCausalLM`: Pythia, GPT-NeoX-20B) checkpoints <-> tfx `Decoder`.

GPT-NeoX is a pre-norm decoder with LayerNorm (weight and bias), biases on its projections, a
plain (ungated) MLP, multi-head attention with rotary positions on the first features of each
head ("half" layout), and by default an output head of its own. Tensors (torch nn.Linear
weights are [out, in], transposed into nnx kernels [in, out]):

- `gpt_neox.embed_in` -> embeddings/tokens/table; `embed_out` (what save_pretrained writes and
  hub checkpoints hold; transformers 5 names it `lm_head` in memory, and both are read) ->
  head/kernel; `gpt_neox.final_layer_norm` -> stack/final_norm;
- per layer `gpt_neox.layers.{i}.`: input_layernorm -> attention_norm, post_attention_layernorm
  -> mlp_norm, attention.dense -> attention/out, mlp.dense_h_to_4h -> mlp/up,
  mlp.dense_4h_to_h -> mlp/down;
- `attention.query_key_value` [3·d, d] and its bias [3·d] pack the three projections head by
  head: transformers views the output as [..., heads, 3·head_dim] and chunks the last axis in
  three, so the rows, viewed as [heads, 3, head_dim], hold head h's query at [h, 0], its key at
  [h, 1] and its value at [h, 2]. Split into attention/query, key and value on load and packed
  again on save.

Config: use_parallel_residual -> mlp.parallel (x + attn(ln1(x)) + mlp(ln2(x)); false: x + attn
then + mlp(ln2(...)), the sequential form); partial_rotary_factor (older configs: rotary_pct;
default 0.25) -> rope.fraction; rope_theta (older configs: rotary_emb_base) -> rope.theta, and
the scalings of `tfx.hf.llama`; hidden_act "gelu" (exact) -> mlp.activation "gelu" ("gelu_new"
and "gelu_pytorch_tanh" -> "gelu_tanh", "relu", "silu"); attention_bias -> biases on the
attention's query, key, value and output projections (attention.qkv_bias and out_bias; the MLP
always has them, use_bias=True); layer_norm_eps -> norm.eps; tie_word_embeddings ->
embeddings.tie. The dropouts (hidden_dropout, attention_dropout) are off on load and tfx's
dropout on save. Refused (ValueError naming the field): other activations, rope types tfx
lacks. The causal-mask buffers older checkpoints hold (attention.bias, attention.masked_bias)
and rotary frequencies are ignored, as transformers ignores them.
"""

from __future__ import annotations

import functools

import numpy as np

from tfx.hf import decoder_parts, plan
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
           "pack_heads", "packed_tensors", "params_from_hf", "params_to_hf", "steps",
           "tensor_names"]

ARCHITECTURES = ("GPTNeoXForCausalLM",)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = (*decoder_parts.IGNORED, r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias)")

# tfx activation -> the hidden_act a save writes; a load also reads the other tanh GELU name.
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
_ACTIVATIONS = {**{hf: tfx for tfx, hf in _HF_ACTIVATIONS.items()},
                "gelu_pytorch_tanh": "gelu_tanh"}
CARD = families.GPT_NEOX  # what every GPT-NeoX is: set on load, checked on save
# GPTNeoXConfig's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(vocab_size=50432, hidden_size=6144, num_hidden_layers=44,
                 num_attention_heads=64, intermediate_size=24576, hidden_act="gelu",
                 max_position_embeddings=2048, layer_norm_eps=1e-5, tie_word_embeddings=False,
                 use_parallel_residual=True, attention_bias=True, rotary_pct=0.25,
                 rotary_emb_base=10000.0)
_EMBED, _HEADS = "gpt_neox.embed_in.weight", ("embed_out.weight", "lm_head.weight")
_QKV = ("query", "key", "value")


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """GPTNeoXConfig fields (config.json as a dict) -> DecoderConfig; dropout off."""
    hf = {**_DEFAULTS, **hf}
    if hf["hidden_act"] not in _ACTIVATIONS:
        raise ValueError(f"{architecture}: hidden_act={hf['hidden_act']!r} is not supported; "
                         f"tfx maps {sorted(_ACTIVATIONS)}")
    # GPTNeoXConfig's precedence: rope_scaling, then rope_parameters, then rotary_emb_base /
    # rotary_pct (a top-level rope_theta or partial_rotary_factor is not read).
    rope = decoder_parts.rope_parameters({
        "rope_scaling": hf.get("rope_scaling"), "rope_parameters": hf.get("rope_parameters"),
        "rope_theta": hf["rotary_emb_base"], "partial_rotary_factor": hf["rotary_pct"]})
    max_len, bias = hf["max_position_embeddings"], bool(hf["attention_bias"])
    return decoder_parts.from_card(CARD, {
        "vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"], "num_heads": hf["num_attention_heads"],
        "d_ff": hf["intermediate_size"], "max_len": max_len, "norm.eps": hf["layer_norm_eps"],
        "embeddings.tie": hf["tie_word_embeddings"], "embeddings.pad_id": hf.get("pad_token_id"),
        "mlp.activation": _ACTIVATIONS[hf["hidden_act"]],
        "mlp.parallel": bool(hf["use_parallel_residual"]),
        "attention.qkv_bias": bias, "attention.out_bias": bias,
        "rope.theta": float(rope["rope_theta"]),
        "rope.fraction": float(rope["partial_rotary_factor"]),
        "rope.scaling": decoder_parts.scaling_from_hf(rope, hf, max_len, architecture,
                                                      partial=True),
        "dropout": 0.0})


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> GPTNeoXConfig fields; ValueError for what GPT-NeoX cannot express."""
    decoder_parts.check_card(config, architecture, CARD)
    if config.mlp.activation not in _HF_ACTIVATIONS:
        raise ValueError(f"{architecture} cannot express mlp.activation="
                         f"{config.mlp.activation!r}; it has {sorted(_HF_ACTIVATIONS)}")
    return {
        "architectures": [architecture], "model_type": "gpt_neox",
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "max_position_embeddings": config.max_len,
        "hidden_act": _HF_ACTIVATIONS[config.mlp.activation],
        "layer_norm_eps": config.norm.eps, "tie_word_embeddings": config.embeddings.tie,
        "use_parallel_residual": config.mlp.parallel,
        "attention_bias": decoder_parts.attention_bias(config, architecture, mlp_bias=True),
        "rope_parameters": {**decoder_parts.scaling_to_hf(config, architecture),
                            "partial_rotary_factor": config.rope.fraction},
        "attention_dropout": config.dropout, "hidden_dropout": config.dropout,
        "dtype": config.compute.param_dtype, "pad_token_id": config.embeddings.pad_id,
    }


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """GPTNeoXForCausalLM tensors -> tfx parameters by state path (every tensor accounted
    for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`)."""
    # The head as save_pretrained names it, or as transformers 5 names it in memory.
    head = next((name for name in _HEADS if name in names), _HEADS[0])
    out = [plan.copy(path, name, transpose=path[-1] == "kernel")
           for path, name in tensor_names(config, head).items()]
    if config.embeddings.tie and head in names:  # a copy: checked, not used
        out.append(plan.tied(head, _EMBED))
    for name, targets in packed_tensors(config).items():
        out.append(plan.Step(targets, (name,),
                             functools.partial(_split_heads, name, config.num_heads)))
    return out


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> GPTNeoXForCausalLM tensors as save_pretrained writes
    them (embed_out left out when tied)."""
    tensors = {name: params[path].T if path[-1] == "kernel" else params[path]
               for path, name in tensor_names(config).items()}
    for name, targets in packed_tensors(config).items():
        tensors[name] = pack_heads([params[path] for path in targets], config.num_heads)
    return tensors


def tensor_names(config: DecoderConfig, head: str = _HEADS[0]) -> dict[tuple, str]:
    """tfx path -> HF tensor name, for every parameter but the packed query, key and value
    (`head`: the output head's name, when the model has one of its own)."""
    names = {("embeddings", "tokens", "table"): _EMBED}
    if not config.embeddings.tie:  # a tied checkpoint's copy is checked by `steps`
        names[("head", "kernel")] = head
    modules = {("stack", "final_norm"): "gpt_neox.final_layer_norm"}
    for i in range(config.num_layers):
        layer, hf = ("stack", "layers", i), f"gpt_neox.layers.{i}"
        modules.update({(*layer, "attention_norm"): f"{hf}.input_layernorm",
                        (*layer, "mlp_norm"): f"{hf}.post_attention_layernorm",
                        (*layer, "attention", "out"): f"{hf}.attention.dense",
                        (*layer, "mlp", "up"): f"{hf}.mlp.dense_h_to_4h",
                        (*layer, "mlp", "down"): f"{hf}.mlp.dense_4h_to_h"})
    has_bias = decoder_parts.biases(config)
    for path, hf in modules.items():
        norm = "norm" in path[-1]
        names[(*path, "scale" if norm else "kernel")] = f"{hf}.weight"
        if norm or has_bias[path[-1] if path[-1] == "out" else "mlp"]:
            names[(*path, "bias")] = f"{hf}.bias"
    return names


def packed_tensors(config: DecoderConfig) -> dict[str, tuple[tuple, ...]]:
    """Packed tensor name -> the query, key and value parameters it holds."""
    has_bias = decoder_parts.biases(config)["query"]
    kinds = {"kernel": "weight", **({"bias": "bias"} if has_bias else {})}
    return {f"gpt_neox.layers.{i}.attention.query_key_value.{suffix}":
            tuple(("stack", "layers", i, "attention", name, kind) for name in _QKV)
            for i in range(config.num_layers) for kind, suffix in kinds.items()}


def _split_heads(name: str, heads: int, packed: np.ndarray) -> list[np.ndarray]:
    """query_key_value weight [3·H·D, d] (or bias [3·H·D]), rows [H, 3, D] -> the query, key
    and value kernels [d, H·D] (biases [H·D])."""
    if packed.shape[0] % (3 * heads):
        raise ValueError(f"tensor {name!r} has shape {packed.shape}: its first dim must pack "
                         f"query, key and value rows for each of {heads} heads")
    rest = packed.shape[1:]
    per_head = packed.reshape(heads, 3, -1, *rest)
    return [per_head[:, j].reshape(-1, *rest).T for j in range(3)]


def pack_heads(parts: list[np.ndarray], heads: int) -> np.ndarray:
    """The inverse of `_split_heads`: query, key and value kernels [d, H·D] (biases [H·D]) ->
    the packed weight [3·H·D, d] (bias [3·H·D])."""
    rows = [np.asarray(part).T for part in parts]  # nn.Linear [out, in]; a bias is itself
    rest = rows[0].shape[1:]
    return np.stack([r.reshape(heads, -1, *rest) for r in rows], axis=1).reshape(-1, *rest)
