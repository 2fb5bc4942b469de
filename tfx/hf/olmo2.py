"""OLMo 2 (`Olmo2ForCausalLM`) checkpoints <-> tfx `Decoder`.

OLMo 2 is LLaMA (RMSNorm, a SwiGLU MLP, grouped-query attention, "half" rotary layout; see
`tfx.hf.llama`) with its norms moved (its card: `tfx.models.families.OLMO2`):

- no norm on a branch's input and one on its output, before the residual sum: x + norm(f(x))
  (norm.inputs=False, norm.outputs=True). Per layer `model.layers.{i}.`:
  post_attention_layernorm -> attention_output_norm (the name LLaMA gives its MLP's input
  norm), post_feedforward_layernorm -> mlp_output_norm;
- queries and keys RMS-normalised over all heads' features at once, after the projections and
  before the rotary positions (attention.qk_norm="across_heads", eps rms_norm_eps):
  self_attn.q_norm [H·D] -> attention/query_norm/norm/scale, self_attn.k_norm [K·D] ->
  attention/key_norm/norm/scale.

Projections, embeddings, the final norm (model.norm) and the head are named as in LLaMA, and so
are the RoPE settings (rope_parameters or the legacy rope_theta / rope_scaling, and their
scalings). attention_bias puts biases on the query, key, value and output projections
(attention.qkv_bias and out_bias; the MLP has none). Refused (ValueError naming the field): a
hidden_act other than "silu", partial_rotary_factor other than 1 (transformers' OLMo 2 rotates
the whole head), rope types tfx lacks.
"""

from __future__ import annotations

import numpy as np

from tfx.hf import decoder_parts, plan
from tfx.models import families
from tfx.models.config import DecoderConfig

__all__ = ["ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
           "params_from_hf", "params_to_hf", "steps", "tensor_names"]

ARCHITECTURES = ("Olmo2ForCausalLM",)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
IGNORED = decoder_parts.IGNORED  # rotary frequency buffers of older checkpoints
CARD = families.OLMO2  # what every OLMo 2 is: set on load, checked on save

# Olmo2Config's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                 head_dim=None, hidden_act="silu", max_position_embeddings=2048,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=1,
                 attention_bias=False)


def config_from_hf(hf: dict, architecture: str) -> DecoderConfig:
    """Olmo2Config fields (config.json as a dict) -> DecoderConfig; dropout off."""
    hf = {**_DEFAULTS, **hf}
    if hf["num_key_value_heads"] is None:  # Olmo2Config: None means MHA
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    # transformers reads a head_dim that config.json names, else hidden_size / heads (as the
    # head_dim that a save writes).
    hf["head_dim"] = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    decoder_parts.check_silu(hf, architecture)
    bias = bool(hf["attention_bias"])
    return decoder_parts.from_card(CARD, {
        **decoder_parts.common_fields(hf), **decoder_parts.rope_fields(hf, architecture),
        "attention.qkv_bias": bias, "attention.out_bias": bias})


def config_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """DecoderConfig -> Olmo2Config fields; ValueError for what OLMo 2 cannot express."""
    decoder_parts.check_card(config, architecture, CARD)
    hf = decoder_parts.common_fields_to_hf(config, architecture, "olmo2")
    hf.update(hidden_act="silu", rope_parameters=decoder_parts.scaling_to_hf(config, architecture),
              attention_bias=decoder_parts.attention_bias(config, architecture, mlp_bias=False))
    return hf


def params_from_hf(tensors: dict[str, np.ndarray], config: DecoderConfig) -> dict:
    """Olmo2ForCausalLM tensors -> tfx parameters by state path (every tensor accounted for)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: DecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`)."""
    return decoder_parts.steps(names, config, tensor_names(config))


def params_to_hf(params: dict, config: DecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> Olmo2ForCausalLM tensors (lm_head left out when tied, as
    save_pretrained does)."""
    return decoder_parts.params_to_hf(params, config, tensor_names(config))


def tensor_names(config: DecoderConfig) -> dict[tuple, str]:
    """tfx path -> HF tensor name, for every parameter of the model."""
    names = decoder_parts.tensor_names(config)  # embeddings, head, projections, q/k and final norms
    for i in range(config.num_layers):
        layer, hf = ("stack", "layers", i), f"model.layers.{i}"
        # The branches' output norms in place of LLaMA's input norms: OLMo 2's
        # post_attention_layernorm follows the attention (LLaMA's precedes the MLP).
        del names[(*layer, "attention_norm", "scale")]
        names[(*layer, "attention_output_norm", "scale")] = names.pop(
            (*layer, "mlp_norm", "scale"))
        names[(*layer, "mlp_output_norm", "scale")] = f"{hf}.post_feedforward_layernorm.weight"
    return names
