"""GPT-2 (`GPT2LMHeadModel`) checkpoints <-> tfx `Decoder`.

GPT-2 is a pre-norm decoder with learned positions, LayerNorm, biases everywhere and a head tied
to the token embedding. Its projections are `Conv1D` modules whose weights are already
[in, out] (nnx.Linear's kernel layout, no transpose), and `attn.c_attn` packs the query, key and
value projections side by side along the output dimension: [d_model, 3 * d_model].
"""

from __future__ import annotations

import functools

import numpy as np

from tfx.hf import decoder_parts, plan
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
           "packed_tensors", "params_from_hf", "params_to_hf", "steps", "tensor_names"]

ARCHITECTURES = ("GPT2LMHeadModel",)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
# Buffers older transformers saved (the causal mask and its fill value): constants, not weights;
# transformers ignores them too.
IGNORED = (r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",)

# HF activation_function -> tfx activation ("gelu_new" is the tanh approximation).
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
CARD = families.GPT2  # what every GPT-2 is: set on load, checked on save
# GPT2Config's defaults, for config.json files that leave a field out (old hub checkpoints do).
_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                 n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 tie_word_embeddings=True, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                 add_cross_attention=False)
# Settings that change GPT-2's numbers and that tfx does not implement: field -> the value tfx has.
_UNSUPPORTED = dict(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                    reorder_and_upcast_attn=False, add_cross_attention=False)
_QKV = ("query", "key", "value")


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """GPT2Config fields (config.json as a dict) -> DecoderConfig; dropout off (HF eval)."""
    hf = {**_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    for name, supported in _UNSUPPORTED.items():
        if hf[name] != supported:
            raise ValueError(f"{architecture}: {name}={hf[name]!r} is not supported by tfx "
                             f"(only {supported!r})")
    if hf["activation_function"] not in _ACTIVATIONS:
        raise ValueError(f"{architecture}: activation_function={hf['activation_function']!r} "
                         f"is not supported; tfx maps {sorted(_ACTIVATIONS)}")
    d_model = hf["n_embd"]
    return decoder_parts.from_card(CARD, {
        "vocab_size": hf["vocab_size"], "d_model": d_model, "num_layers": hf["n_layer"],
        "num_heads": hf["n_head"], "d_ff": hf["n_inner"] or 4 * d_model,
        "max_len": hf["n_positions"], "mlp.activation": _ACTIVATIONS[hf["activation_function"]],
        "norm.eps": hf["layer_norm_epsilon"], "embeddings.tie": hf["tie_word_embeddings"],
        "embeddings.pad_id": hf.get("pad_token_id"), "dropout": 0.0})


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> GPT2Config fields; ValueError for what GPT-2 cannot express."""
    decoder_parts.check_card(config, architecture, CARD)
    activations = {tfx: hf for hf, tfx in _ACTIVATIONS.items()}
    if config.mlp.activation not in activations:
        raise ValueError(f"{architecture} cannot express mlp.activation="
                         f"{config.mlp.activation!r}; "
                         f"it has {sorted(activations)}")
    return {
        "architectures": [architecture], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_len, "n_embd": config.d_model,
        "n_layer": config.num_layers, "n_head": config.num_heads, "n_inner": config.d_ff,
        "activation_function": activations[config.mlp.activation],
        "layer_norm_epsilon": config.norm.eps, "tie_word_embeddings": config.embeddings.tie,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout, "dtype": config.compute.param_dtype,
        "pad_token_id": config.embeddings.pad_id, **_UNSUPPORTED,
    }


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """GPT2LMHeadModel tensors -> tfx parameters by state path (every tensor accounted for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`)."""
    # OpenAI's hub checkpoints were saved from GPT2Model, without the "transformer." prefix;
    # transformers loads them into GPT2LMHeadModel, and so does tfx.
    bare = "transformer.wte.weight" not in names and "wte.weight" in names

    def hf(name: str) -> str:
        return name.removeprefix("transformer.") if bare else name

    out = [plan.copy(path, hf(name)) for path, name in tensor_names(config).items()]
    for name, targets in packed_tensors(config).items():
        out.append(plan.Step(targets, (hf(name),), functools.partial(_split_qkv, hf(name))))
    if not config.embeddings.tie:  # nn.Linear [out, in]
        out.append(plan.copy(("head", "kernel"), "lm_head.weight", transpose=True))
    elif "lm_head.weight" in names:  # a tied checkpoint may hold a copy: checked, not used
        out.append(plan.tied("lm_head.weight", hf("transformer.wte.weight")))
    return out


def _split_qkv(name: str, packed: np.ndarray) -> list[np.ndarray]:
    if packed.shape[-1] % 3:
        raise ValueError(f"tensor {name!r} has shape {packed.shape}: its last dim must pack "
                         "q, k and v")
    return np.split(packed, 3, axis=-1)


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> GPT2LMHeadModel tensors (lm_head left out when tied, as
    save_pretrained does)."""
    tensors = {name: params[path] for path, name in tensor_names(config).items()}
    for name, targets in packed_tensors(config).items():
        tensors[name] = np.concatenate([params[path] for path in targets], axis=-1)
    if not config.embeddings.tie:
        tensors["lm_head.weight"] = params[("head", "kernel")].T
    return tensors


def packed_tensors(config: DecoderConfig) -> dict[str, tuple[tuple, ...]]:
    """Packed tensor name -> the query, key and value parameters it holds side by side:
    `attn.c_attn.weight` [d, 3·d] (Conv1D, [in, out]) and its bias [3·d]."""
    return {f"transformer.h.{i}.attn.c_attn.{suffix}":
            tuple(("stack", "layers", i, "attention", name, kind) for name in _QKV)
            for i in range(config.num_layers) for kind, suffix in (("kernel", "weight"),
                                                                   ("bias", "bias"))}


def tensor_names(config: DecoderConfig) -> dict[tuple, str]:
    """tfx path -> HF name of every tensor that maps one to one (all but c_attn and lm_head)."""
    names = {("embeddings", "tokens", "table"): "transformer.wte.weight",
             ("embeddings", "positions", "table"): "transformer.wpe.weight"}
    modules = {("stack", "final_norm"): "transformer.ln_f"}
    for i in range(config.num_layers):
        layer, hf = ("stack", "layers", i), f"transformer.h.{i}"
        modules.update({(*layer, "attention_norm"): f"{hf}.ln_1",
                        (*layer, "attention", "out"): f"{hf}.attn.c_proj",
                        (*layer, "mlp_norm"): f"{hf}.ln_2",
                        (*layer, "mlp", "up"): f"{hf}.mlp.c_fc",
                        (*layer, "mlp", "down"): f"{hf}.mlp.c_proj"})
    for path, hf in modules.items():
        weight = "scale" if "norm" in path[-1] else "kernel"
        names.update({(*path, weight): f"{hf}.weight", (*path, "bias"): f"{hf}.bias"})
    return names
