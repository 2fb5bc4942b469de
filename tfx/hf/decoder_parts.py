"""What the LLaMA-style decoders' converters share (`tfx.hf.llama`, `mistral` in it, `mixtral`,
`qwen`, `gemma`, `olmo2`, `phi3`, `deepseek`; `gpt_neox`, `gpt2`, `bert` and `t5` for the card
check): the config.json fields they all read, RoPE settings and scalings, bias flags, LLaMA's
tensor names, the plan that copies them, and `check_card`, the export check against a family
card (`tfx.models.families`).

RoPE settings: transformers 5 writes `rope_parameters` (`rope_theta`, `rope_type` and the type's
fields); older configs have a top-level `rope_theta` and a `rope_scaling` dict (`type` or
`rope_type`). Both are read; they map onto the `tfx.ops.positional` scaling objects, whose field
names are HF's. HF stores q/k in the "half" rotary layout (`rotate_half`), so the weights need no
permutation; torch `nn.Linear` weights are [out, in] and are transposed into nnx kernels
[in, out].
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfx.hf import plan
from tfx.models.config import SUBCONFIGS, DecoderConfig, TransformerConfig
from tfx.models.families import Family
from tfx.ops.positional import DynamicNTKScaling, LinearScaling, Llama3Scaling, YaRNScaling

__all__ = ["IGNORED", "attention_bias", "biases", "check_card", "check_silu", "common_fields",
           "common_fields_to_hf", "from_card", "params_to_hf", "rope_fields", "rope_parameters",
           "scaling_from_hf", "scaling_to_hf", "steps", "tensor_names"]

# The rotary frequencies older transformers saved per layer: computed from the config, not
# weights; transformers ignores them too.
IGNORED = (r"(.*\.)?rotary_emb\.inv_freq",)
# rope_type -> tfx scaling; the dataclass fields carry HF's names.
_SCALINGS = {"linear": LinearScaling, "dynamic": DynamicNTKScaling, "yarn": YaRNScaling,
             "llama3": Llama3Scaling}


def from_card(card: Family, fields: dict) -> DecoderConfig:
    """The DecoderConfig of a checkpoint of family `card` whose config.json gives `fields` (by
    dotted name: sizes and the choices the family leaves free; ValueError for a field the card
    fixes, which a converter does not decide)."""
    return card.config(fields)


def rope_fields(hf: dict, architecture: str, default_theta: float = 10000.0) -> dict:
    """rope.theta and rope.scaling (by dotted name) of a LLaMA-style config.json whose defaults
    are filled in; `default_theta` is the rope_theta of a config that names none."""
    rope = rope_parameters(hf)
    return {"rope.theta": float(rope.get("rope_theta", default_theta)),
            "rope.scaling": scaling_from_hf(rope, hf, hf["max_position_embeddings"],
                                            architecture)}


def check_silu(hf: dict, architecture: str) -> None:
    """ValueError unless the gated MLP's hidden_act is "silu" (SwiGLU), which the cards of the
    LLaMA-style families fix."""
    if hf["hidden_act"] != "silu":
        raise ValueError(f"{architecture}: hidden_act={hf['hidden_act']!r} is not supported "
                         "(tfx maps the gated 'silu' MLP)")


def check_card(config: TransformerConfig, architecture: str, card: Family) -> None:
    """ValueError unless `config` is a model of family `card` (`Family.mismatches`), naming
    every field that differs; the BERT and T5 converters check with it too."""
    if type(config) is not card.kind:
        raise ValueError(f"{architecture} needs {card.kind.__name__}, got {type(config).__name__}")
    wrong = card.mismatches(config)
    if wrong:
        raise ValueError(f"{architecture} cannot express "
                         + "; ".join(_mismatch(name, *values) for name, values in wrong.items()))


def _mismatch(name: str, value, expected) -> str:
    if name in SUBCONFIGS and expected == "present":
        return f"{name}=None (it needs {name})"
    if name in SUBCONFIGS and value == "present":
        return f"{name} (it has none)"
    return f"{name}={value!r} (it has {name}={expected!r})"


def common_fields(hf: dict) -> dict:
    """The DecoderConfig fields (by dotted name) that every LLaMA-style config.json (Mixtral's,
    Gemma's, ...) gives alike, from one whose defaults are filled in: sizes, norm epsilon, tied
    head, padding token; dropout off."""
    return {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
            "num_layers": hf["num_hidden_layers"], "num_heads": hf["num_attention_heads"],
            "attention.num_kv_heads": hf["num_key_value_heads"],
            "attention.head_dim": hf["head_dim"], "d_ff": hf["intermediate_size"],
            "max_len": hf["max_position_embeddings"], "norm.eps": hf["rms_norm_eps"],
            "embeddings.tie": hf["tie_word_embeddings"],
            "embeddings.pad_id": hf.get("pad_token_id"), "dropout": 0.0}


def common_fields_to_hf(config: DecoderConfig, architecture: str, model_type: str) -> dict:
    """The config.json fields of `common_fields`, and the architecture, model type and dtype."""
    return {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.kv_heads,
        "head_dim": config.attention.head_dim or config.d_model // config.num_heads,
        "max_position_embeddings": config.max_len, "rms_norm_eps": config.norm.eps,
        "tie_word_embeddings": config.embeddings.tie, "attention_dropout": config.dropout,
        "dtype": config.compute.param_dtype, "pad_token_id": config.embeddings.pad_id,
    }


def steps(names, config: DecoderConfig, tensors: dict[tuple, str] | None = None
          ) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`); for a
    Mixtral config, all but the experts and routers. `tensors`: tfx path -> HF name of the
    tensors copied one to one (default `tensor_names(config)`; a LLaMA-like family that names
    or packs some otherwise passes its own: `tfx.hf.olmo2`, `tfx.hf.phi3`)."""
    tensors = tensor_names(config) if tensors is None else tensors
    out = [plan.copy(path, name, transpose=path[-1] == "kernel")
           for path, name in tensors.items()]
    if config.embeddings.tie and "lm_head.weight" in names:  # a copy: checked, not used
        out.append(plan.tied("lm_head.weight", "model.embed_tokens.weight"))
    return out


def params_to_hf(params: dict, config: DecoderConfig, tensors: dict[tuple, str] | None = None
                 ) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> HF tensors (lm_head left out when tied, as
    save_pretrained does); `tensors` as for `steps`."""
    tensors = tensor_names(config) if tensors is None else tensors
    return {name: _transposed(path, params[path]) for path, name in tensors.items()}


def _transposed(path: tuple, value: np.ndarray) -> np.ndarray:
    # nn.Linear weights are [out, in], nnx kernels [in, out]; the transpose is its own inverse.
    return value.T if path[-1] == "kernel" else value


def tensor_names(config: DecoderConfig) -> dict[tuple, str]:
    """tfx path -> HF tensor name, for every parameter of the model but experts (the layers
    that have experts in place of the MLP, `config.is_moe_layer`: `tfx.hf.mixtral` names
    those). Biases are where `biases` says; per-head query/key norms (Qwen 3, Gemma 3) are
    `self_attn.q_norm` / `k_norm`."""
    names = {("embeddings", "tokens", "table"): "model.embed_tokens.weight",
             ("stack", "final_norm", "scale"): "model.norm.weight"}
    if not config.embeddings.tie:  # a tied checkpoint's lm_head.weight is checked by `steps`
        names[("head", "kernel")] = "lm_head.weight"
    attention = {("attention", "query"): "self_attn.q_proj",
                 ("attention", "key"): "self_attn.k_proj",
                 ("attention", "value"): "self_attn.v_proj",
                 ("attention", "out"): "self_attn.o_proj"}
    mlp = {("mlp", "gate"): "mlp.gate_proj", ("mlp", "up"): "mlp.up_proj",
           ("mlp", "down"): "mlp.down_proj"}
    has_bias = biases(config)
    for i in range(config.num_layers):
        layer, hf = ("stack", "layers", i), f"model.layers.{i}"
        names[(*layer, "attention_norm", "scale")] = f"{hf}.input_layernorm.weight"
        names[(*layer, "mlp_norm", "scale")] = f"{hf}.post_attention_layernorm.weight"
        projections = attention if config.is_moe_layer(i) else attention | mlp
        for path, module in projections.items():
            names[(*layer, *path, "kernel")] = f"{hf}.{module}.weight"
            if has_bias[path[-1] if path[0] == "attention" else "mlp"]:
                names[(*layer, *path, "bias")] = f"{hf}.{module}.bias"
        if config.attention.qk_norm is not None:
            for ours, theirs in (("query_norm", "q_norm"), ("key_norm", "k_norm")):
                names[(*layer, "attention", ours, "norm", "scale")] = \
                    f"{hf}.self_attn.{theirs}.weight"
    return names


def biases(config: DecoderConfig) -> dict[str, bool]:
    """Which projections have a bias: "query", "key", "value" (attention.qkv_bias), "out"
    (attention.out_bias) and "mlp" (use_bias); the attention's None means use_bias."""
    qkv, out = config.attention.qkv_bias, config.attention.out_bias
    qkv = config.use_bias if qkv is None else qkv
    return {"query": qkv, "key": qkv, "value": qkv, "mlp": config.use_bias,
            "out": config.use_bias if out is None else out}


def attention_bias(config: DecoderConfig, architecture: str, *, mlp_bias: bool) -> bool:
    """The one attention_bias flag of config.json (biases on the query, key, value and output
    projections alike: OLMo 2, Phi-3, GPT-NeoX) for a model whose MLP has biases iff
    `mlp_bias`; ValueError for a config with other biases."""
    has = biases(config)
    if has["mlp"] != mlp_bias:
        raise ValueError(f"{architecture} cannot express use_bias={config.use_bias} (its MLP "
                         f"has {'biases' if mlp_bias else 'no biases'})")
    if len({has[name] for name in ("query", "key", "value", "out")}) > 1:
        raise ValueError(f"{architecture} cannot express attention.qkv_bias="
                         f"{config.attention.qkv_bias} with attention.out_bias="
                         f"{config.attention.out_bias} (attention_bias puts biases on the "
                         "query, key, value and output projections alike)")
    return has["out"]


def rope_parameters(hf: dict) -> dict:
    """One flat dict of RoPE settings from either config format, with HF's precedence: a legacy
    rope_scaling over rope_parameters, their fields over the top-level rope_theta /
    partial_rotary_factor."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    for name in ("rope_theta", "partial_rotary_factor"):
        if hf.get(name) is not None:
            rope.setdefault(name, hf[name])
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def scaling_from_hf(rope: dict, hf: dict, max_len: int, architecture: str, *,
                    partial: bool = False):
    """HF rope settings -> None or a tfx scaling object. `partial`: the architecture rotates
    the first int(head_dim · partial_rotary_factor) features (GPT-NeoX, Phi-3: rope.fraction,
    which the caller reads); otherwise a factor other than 1 is refused."""
    fraction = rope.get("partial_rotary_factor", 1.0)
    if fraction != 1.0 and not partial:
        # transformers' Llama, Mistral and Gemma rotate the whole head whatever this says
        # (default rope) or fail (scaled rope), so no value but 1.0 has a meaning to load.
        raise ValueError(f"{architecture}: partial_rotary_factor={fraction} is not supported "
                         f"(transformers' {architecture} rotates the whole head)")
    kind = rope["rope_type"]
    if kind == "default":
        return None
    if kind not in _SCALINGS:
        raise ValueError(f"{architecture}: rope_type={kind!r} is not supported; tfx maps "
                         f"{['default', *_SCALINGS]}")
    cls = _SCALINGS[kind]
    # HF reads the betas with `or` and the mscales by truthiness: 0 means "not given".
    falsy_unset = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    fields = {f.name: rope.get(f.name) for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in fields.items() if v is not None and (v or k not in falsy_unset)}
    if kind == "dynamic":
        # HF's dynamic NTK grows the base past max_position_embeddings, not a rope field.
        fields["original_max_position_embeddings"] = max_len
    elif kind in ("yarn", "llama3"):
        # HF: a top-level original_max_position_embeddings wins, then the rope field, then
        # max_position_embeddings.
        original = hf.get("original_max_position_embeddings") or fields.get(
            "original_max_position_embeddings", max_len)
        fields["original_max_position_embeddings"] = original
        if kind == "yarn":
            fields.setdefault("factor", max_len / original)
    try:
        return cls(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{architecture}: rope_parameters {rope} are not valid: {error}") from None


def scaling_to_hf(config: DecoderConfig, architecture: str) -> dict:
    """tfx rope.theta + rope.scaling -> HF rope_parameters."""
    scaling = config.rope.scaling
    rope = {"rope_theta": config.rope.theta, "rope_type": "default"}
    if scaling is None:
        return rope
    kinds = {cls: kind for kind, cls in _SCALINGS.items()}
    if type(scaling) not in kinds:
        raise ValueError(f"{architecture} cannot express rope.scaling={scaling!r}; it has "
                         f"{[cls.__name__ for cls in kinds]}")
    fields = {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}
    if isinstance(scaling, DynamicNTKScaling):
        original = fields.pop("original_max_position_embeddings")
        if original != config.max_len:
            raise ValueError(
                f"{architecture} cannot express DynamicNTKScaling with "
                f"original_max_position_embeddings={original} != max_len={config.max_len} "
                "(HF's dynamic rope grows past max_position_embeddings)")
    return {**rope, "rope_type": kinds[type(scaling)], **fields}
