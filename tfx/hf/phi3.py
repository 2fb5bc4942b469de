"""Phi-3 (`Phi3ForCausalLM`) checkpoints <-> tfx `Decoder`.

Phi-3 is LLaMA (RMSNorm, a SwiGLU MLP, grouped-query attention, "half" rotary layout, no
biases; see `tfx.hf.llama`; its card: `tfx.models.families.PHI3`) with two fused projections
per layer, split on load and fused again on save (torch [out, in] rows; nnx kernels are [in, out]):

- `self_attn.qkv_proj` [(H + 2K)·D, d]: the H·D query rows, then the K·D key rows, then the
  K·D value rows -> attention/query, key, value kernels [d, H·D], [d, K·D], [d, K·D];
- `mlp.gate_up_proj` [2f, d]: the gate rows, then the up rows (transformers chunks the output
  in two and multiplies act(first half) by the second) -> mlp/gate, up kernels [d, f].

Every other tensor is named as in LLaMA: input_layernorm -> attention_norm,
post_attention_layernorm -> mlp_norm, self_attn.o_proj, mlp.down_proj, model.norm,
model.embed_tokens, lm_head.

Config: sliding_window (every layer; None: full attention) -> attention.sliding_window;
partial_rotary_factor (in rope_parameters or top-level) -> rope.fraction, the first
int(head_dim · fraction) features of each head rotated; rope_theta -> rope.theta; head_dim when
config.json names one (transformers reads it then), else hidden_size / heads. The dropouts
(resid_pdrop, embd_pdrop, attention_dropout) are off on load and tfx's dropout on save.

Left out: LongRoPE (`rope_type` "longrope", or its older names "su" and "yarn"), the scaling of
Phi-3's long-context checkpoints (Phi-3-mini-128k, Phi-3.5-mini, ...): tfx has no such scaling,
so those configs are refused with a ValueError naming rope_type. The 4k-context checkpoints
(Phi-3-mini-4k) have none, and transformers' Phi-3 takes no other scaling. Also refused: a
hidden_act other than "silu".
"""

from __future__ import annotations

import functools

import numpy as np

from tfx.hf import decoder_parts, plan
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
           "fused_tensors", "params_from_hf", "params_to_hf", "steps", "tensor_names"]

ARCHITECTURES = ("Phi3ForCausalLM",)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = decoder_parts.IGNORED  # rotary frequency buffers of older checkpoints
CARD = families.PHI3  # what every Phi-3 is: set on load, checked on save

# Phi3Config's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                 head_dim=None, hidden_act="silu", max_position_embeddings=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=32000,
                 sliding_window=None)
# Names transformers' Phi3Config gives LongRoPE ("su" and "yarn" are read as "longrope").
_LONGROPE = ("longrope", "su", "yarn")


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """Phi3Config fields (config.json as a dict) -> DecoderConfig; dropout off."""
    hf = {**_DEFAULTS, **hf}
    if hf["num_key_value_heads"] is None:  # Phi3Config: None means MHA
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    # transformers reads a head_dim that config.json names, else hidden_size / heads (as the
    # head_dim that a save writes).
    hf["head_dim"] = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    decoder_parts.check_silu(hf, architecture)
    rope = decoder_parts.rope_parameters(hf)
    kind = rope["rope_type"]
    if kind in _LONGROPE:
        raise ValueError(f"{architecture}: rope_type={kind!r} (LongRoPE, Phi-3's long-context "
                         "scaling) is not supported: tfx has no LongRoPE")
    if kind != "default":
        raise ValueError(f"{architecture}: rope_type={kind!r} is not supported (transformers' "
                         "Phi-3 takes 'default' or 'longrope')")
    return decoder_parts.from_card(CARD, {
        **decoder_parts.common_fields(hf), "attention.sliding_window": hf["sliding_window"],
        "rope.theta": float(rope.get("rope_theta", 10000.0)),
        "rope.fraction": float(rope.get("partial_rotary_factor", 1.0))})


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> Phi3Config fields; ValueError for what Phi-3 cannot express."""
    decoder_parts.check_card(config, architecture, CARD)
    hf = decoder_parts.common_fields_to_hf(config, architecture, "phi3")
    hf.update(hidden_act="silu", sliding_window=config.attention.sliding_window,
              rope_parameters={**decoder_parts.scaling_to_hf(config, architecture),
                               "partial_rotary_factor": config.rope.fraction},
              resid_pdrop=config.dropout, embd_pdrop=config.dropout)
    return hf


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """Phi3ForCausalLM tensors -> tfx parameters by state path (every tensor accounted for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`): LLaMA's
    copies, and the fused tensors split by rows."""
    out = decoder_parts.steps(names, config, tensor_names(config))
    for name, (paths, rows) in fused_tensors(config).items():
        out.append(plan.Step(paths, (name,), functools.partial(_split_rows, name, rows)))
    return out


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> Phi3ForCausalLM tensors (lm_head left out when tied, as
    save_pretrained does)."""
    tensors = decoder_parts.params_to_hf(params, config, tensor_names(config))
    for name, (paths, _) in fused_tensors(config).items():
        tensors[name] = np.concatenate([np.asarray(params[path]).T for path in paths])
    return tensors


def fused_tensors(config: DecoderConfig) -> dict[str, tuple[tuple, tuple[int, ...]]]:
    """Fused tensor name -> (the kernels it packs, in order; their rows in it)."""
    head_dim = config.attention.head_dim or config.d_model // config.num_heads
    q, kv, f = config.num_heads * head_dim, config.kv_heads * head_dim, config.d_ff
    out = {}
    for i in range(config.num_layers):
        layer, hf = ("stack", "layers", i), f"model.layers.{i}"
        out[f"{hf}.self_attn.qkv_proj.weight"] = (
            tuple((*layer, "attention", name, "kernel") for name in ("query", "key", "value")),
            (q, kv, kv))
        out[f"{hf}.mlp.gate_up_proj.weight"] = (
            tuple((*layer, "mlp", name, "kernel") for name in ("gate", "up")), (f, f))
    return out


def tensor_names(config: DecoderConfig) -> dict[tuple, str]:
    """tfx path -> HF tensor name of the tensors copied one to one: LLaMA's
    (`tfx.hf.decoder_parts.tensor_names`) but the kernels that `fused_tensors` packs."""
    fused = {path for paths, _ in fused_tensors(config).values() for path in paths}
    return {path: name for path, name in decoder_parts.tensor_names(config).items()
            if path not in fused}


def _split_rows(name: str, rows: tuple[int, ...], weight: np.ndarray) -> tuple[np.ndarray, ...]:
    """A fused nn.Linear weight [sum(rows), d] -> one kernel [d, n] per n in `rows`."""
    if weight.ndim != 2 or weight.shape[0] != sum(rows):
        raise ValueError(f"tensor {name!r} has shape {weight.shape}, expected [{sum(rows)}, d] "
                         f"({' + '.join(map(str, rows))} rows)")
    return tuple(part.T for part in np.split(weight, np.cumsum(rows)[:-1]))
