"""ModernBERT checkpoints (ModernBertModel, ModernBertForMaskedLM) <-> `tfx.models.Encoder`.

What every ModernBERT is lives in its card, `tfx.models.families.MODERNBERT`: a pre-norm encoder
whose token embeddings are normalised (embeddings.norm; no absolute positions, no token types)
and read by the first layer's attention as they are (norm.first_attention=False: transformers'
Identity attn_norm of layer 0), rotary positions, a GeGLU MLP. config.json gives the sizes and:

- layer_types ("full_attention" / "sliding_attention"; older files: every
  global_attn_every_n_layers-th layer global, from the first) -> attention.layer_types;
- local_attention: a local layer's token sees the tokens at most local_attention // 2 away on
  either side -> attention.sliding_window = local_attention // 2 + 1 (an encoder's window is
  the distance it stays under, `tfx.models.parts.AttentionConfig`);
- the rotary bases of the global and local layers (rope_parameters, or the older
  global_rope_theta / local_rope_theta) -> rope.theta and rope.local_theta;
- norm_bias -> norm.bias; attention_bias, mlp_bias and classifier_bias (which must agree) ->
  use_bias; hidden_activation (the MLM head's classifier_activation must be the same).

Tensors, under `model.` in ModernBertForMaskedLM: embeddings.tok_embeddings, embeddings.norm,
per layer `layers.{i}.` attn_norm (none in layer 0), attn.Wqkv (queries, keys, values stacked by
rows: split on load, fused on save), attn.Wo, mlp_norm, mlp.Wi (the activated input, then the
gate it multiplies: tfx's gate then up), mlp.Wo; final_norm. The MLM head: head.dense ->
mlm_transform, head.norm -> mlm_norm, decoder.bias -> mlm_bias, decoder.weight tied to the
token embeddings. Heads a checkpoint lacks keep their initial values (`OPTIONAL_PARAMS`), as in
`tfx.hf.bert`; the Encoder's BERT pooler is never in a ModernBERT checkpoint.

transformers runs a padded batch with a padding mask in eager and sdpa attention (it unpads only
with flash attention), which is what `Encoder(input_ids, attention_mask=...)` computes.

Refused (ValueError naming the field): rope types other than "default", attention, MLP and head
biases that differ, a classifier_activation other than hidden_activation, decoder_bias=False,
untied decoder weights, activations tfx lacks.
"""

from __future__ import annotations

import functools

import numpy as np

from tfx.hf import plan
from tfx.hf.bert import encoder_copies
from tfx.hf.decoder_parts import check_card
from tfx.models import families
from tfx.models.config import EncoderConfig

__all__ = ["ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
           "params_from_hf", "params_to_hf", "steps", "tensor_table"]

ARCHITECTURES = ("ModernBertModel", "ModernBertForMaskedLM")
# Heads that a checkpoint may lack (path prefixes in the Encoder): ModernBertModel has no MLM
# head, and no ModernBERT has BERT's pooler.
OPTIONAL_PARAMS = (("pooler",), ("mlm_transform",), ("mlm_norm",), ("mlm_bias",))
IGNORED: tuple = ()
CARD = families.MODERNBERT  # what every ModernBERT is: set on load, checked on save
# ModernBertConfig's defaults, for config.json files that leave a field out; mask_token_id is
# no field of it (ModernBERT's tokenizer has [MASK] = 50284), written by `config_to_hf`.
_DEFAULTS = dict(vocab_size=50368, hidden_size=768, intermediate_size=1152,
                 num_hidden_layers=22, num_attention_heads=12, hidden_activation="gelu",
                 max_position_embeddings=8192, norm_eps=1e-5, norm_bias=False,
                 pad_token_id=50283, cls_token_id=50281, sep_token_id=50282,
                 mask_token_id=50284, attention_bias=False, mlp_bias=False,
                 classifier_bias=False, classifier_activation="gelu", decoder_bias=True,
                 local_attention=128, global_attn_every_n_layers=3, global_rope_theta=160000.0,
                 local_rope_theta=10000.0, tie_word_embeddings=True)
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu"}
_ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_LAYER_TYPES_TO_HF = {ours: theirs for theirs, ours in _LAYER_TYPES.items()}
_PREFIX = {"ModernBertModel": "", "ModernBertForMaskedLM": "model."}
_DECODER = "decoder.weight"  # the MLM decoder, tied to the token embeddings
# Tensor names of each kind of torch module, and whether the weight is transposed:
# torch nn.Linear stores [out, in], nnx.Linear [in, out].
_KINDS = {"linear": (("weight", "kernel", True), ("bias", "bias", False)),
          "norm": (("weight", "scale", False), ("bias", "bias", False)),
          "embedding": (("weight", "table", False),)}

Path = tuple[str | int, ...]


def config_from_hf(hf: dict, architecture: str) -> EncoderConfig:
    """ModernBertConfig fields (config.json as a dict) -> EncoderConfig, a model of the card;
    dropout off. Settings tfx cannot honour raise ValueError naming the field."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    hf = {**_DEFAULTS, **hf}
    act = hf["hidden_activation"]
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation={act!r} is not supported; tfx maps "
                         f"{sorted(_ACTIVATIONS)}")
    if hf["classifier_activation"] != act:
        raise ValueError(f"classifier_activation={hf['classifier_activation']!r} differs from "
                         f"hidden_activation={act!r}: the tfx masked-LM head uses the model's "
                         "activation")
    for field in ("decoder_bias", "tie_word_embeddings"):
        if not hf[field]:
            raise ValueError(f"{field}=False is not supported: the tfx masked-LM head is the "
                             "tied token embeddings plus a bias")
    return CARD.config({
        "vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"], "num_heads": hf["num_attention_heads"],
        "d_ff": hf["intermediate_size"], "max_len": hf["max_position_embeddings"],
        "use_bias": _bias(hf), "norm.eps": hf["norm_eps"], "norm.bias": bool(hf["norm_bias"]),
        "mlp.activation": _ACTIVATIONS[act], **_rope_fields(hf),
        "attention.sliding_window": hf["local_attention"] // 2 + 1,
        "attention.layer_types": _layer_types(hf),
        "special_tokens": {"pad_id": hf["pad_token_id"], "cls_id": hf["cls_token_id"],
                           "sep_id": hf["sep_token_id"], "mask_id": hf["mask_token_id"]},
        "dropout": 0.0})


def _bias(hf: dict) -> bool:
    """One use_bias for attention_bias, mlp_bias and classifier_bias, which must agree."""
    names = ("attention_bias", "mlp_bias", "classifier_bias")
    values = {name: bool(hf[name]) for name in names}
    if len(set(values.values())) > 1:
        raise ValueError(f"{values} differ: tfx has one use_bias for the projections of the "
                         "attention, the MLP and the masked-LM head")
    return values["attention_bias"]


def _rope_fields(hf: dict) -> dict:
    """rope.theta (global layers) and rope.local_theta (local ones) from rope_parameters, or
    the older global_rope_theta / local_rope_theta."""
    if hf.get("rope_scaling") is not None:
        raise ValueError(f"rope_scaling={hf['rope_scaling']!r} is not supported: tfx loads "
                         "ModernBERT with its default rotary positions")
    params = hf.get("rope_parameters") or {}
    thetas = {}
    for kind, field, legacy in (("full_attention", "rope.theta", "global_rope_theta"),
                                ("sliding_attention", "rope.local_theta", "local_rope_theta")):
        rope = params.get(kind) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_parameters[{kind!r}].rope_type={rope_type!r} is not "
                             "supported: tfx loads ModernBERT with 'default' rotary positions")
        thetas[field] = float(rope.get("rope_theta", hf[legacy]))
    return thetas


def _layer_types(hf: dict) -> tuple[str, ...]:
    """Per layer "full" or "sliding", from layer_types or global_attn_every_n_layers."""
    types = hf.get("layer_types")
    if types is None:
        every = hf["global_attn_every_n_layers"]
        return tuple("sliding" if i % every else "full" for i in range(hf["num_hidden_layers"]))
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types has {unknown}; ModernBERT's are {sorted(_LAYER_TYPES)}")
    return tuple(_LAYER_TYPES[kind] for kind in types)


def config_to_hf(config: EncoderConfig, architecture: str) -> dict:
    """The ModernBertConfig dict (config.json) of an EncoderConfig that ModernBERT can express
    (a model of the card); ValueError naming each field it cannot."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    check_card(config, architecture, CARD)
    c = config
    if c.mlp.activation not in _ACTIVATIONS_TO_HF:
        raise ValueError(f"mlp.activation={c.mlp.activation!r} cannot be written as "
                         f"{architecture}; ModernBERT takes {sorted(_ACTIVATIONS_TO_HF)}")
    window = c.attention.sliding_window
    local_theta = c.rope.theta if c.rope.local_theta is None else c.rope.local_theta
    act = _ACTIVATIONS_TO_HF[c.mlp.activation]
    tokens = c.special_tokens
    return {
        "architectures": [architecture], "model_type": "modernbert",
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "intermediate_size": c.d_ff,
        "max_position_embeddings": c.max_len, "hidden_activation": act,
        "classifier_activation": act, "norm_eps": c.norm.eps, "norm_bias": c.norm.bias,
        "attention_bias": c.use_bias, "mlp_bias": c.use_bias, "classifier_bias": c.use_bias,
        "decoder_bias": True, "tie_word_embeddings": True,
        # A window of w positions: local_attention // 2 = w - 1 tokens on either side.
        "local_attention": 2 * (window - 1) if window is not None else _DEFAULTS["local_attention"],
        "layer_types": [_LAYER_TYPES_TO_HF[c.layer_type(i)] for i in range(c.num_layers)],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": c.rope.theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        "pad_token_id": tokens.pad_id, "cls_token_id": tokens.cls_id,
        "sep_token_id": tokens.sep_id, "bos_token_id": tokens.cls_id,
        "eos_token_id": tokens.sep_id, "mask_token_id": tokens.mask_id,
        # tfx drops out residual branches and embeddings, never attention probabilities.
        "embedding_dropout": c.dropout, "mlp_dropout": c.dropout, "attention_dropout": 0.0,
    }


def params_from_hf(tensors: dict[str, np.ndarray], config: EncoderConfig) -> dict[Path, np.ndarray]:
    """ModernBERT tensors (with or without the `model.` prefix) -> Encoder parameters by state
    path (every tensor accounted for). Heads without any tensor are left out (they keep their
    initial values, `OPTIONAL_PARAMS`)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: EncoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`): the
    encoder, the MLM head when it has any tensor in `names`, the fused projections split by
    rows, and the tied decoder weight when present."""
    names = set(names)
    prefix = "model." if any(name.startswith("model.") for name in names) else ""
    out = encoder_copies(names, tensor_table(config), functools.partial(_full, prefix),
                         "ModernBERT")
    for name, (paths, rows) in fused_tensors(config).items():
        out.append(plan.Step(paths, (prefix + name,), functools.partial(_split_rows, name, rows),
                             "the ModernBERT encoder needs it"))
    if _DECODER in names:
        out.append(plan.tied(_DECODER, prefix + "embeddings.tok_embeddings.weight",
                             "tfx supports the tied masked-LM decoder only"))
    return out


def params_to_hf(params: dict[Path, np.ndarray], config: EncoderConfig) -> dict[str, np.ndarray]:
    """Encoder parameters -> ModernBertForMaskedLM tensors (the decoder weight left out, tied as
    save_pretrained does); ModernBertModel reads its `model.*` part."""
    tensors = {_full("model.", name): params[path].T if transpose else params[path]
               for entries in tensor_table(config).values()
               for name, path, transpose in entries}
    for name, (paths, _) in fused_tensors(config).items():
        tensors["model." + name] = np.concatenate([np.asarray(params[path]).T for path in paths])
    return tensors


def tensor_table(config: EncoderConfig) -> dict[str, list[tuple[str, Path, bool]]]:
    """(HF tensor name without `model.`, tfx path, transposed) for the tensors copied one to
    one, by group: "encoder" (required) and "masked-LM" (the optional head)."""
    modules = [("embeddings.tok_embeddings", ("embeddings", "tokens"), "embedding"),
               ("embeddings.norm", ("embeddings", "norm"), "norm"),
               ("final_norm", ("stack", "final_norm"), "norm")]
    for i in range(config.num_layers):
        hf, ours = f"layers.{i}.", ("stack", "layers", i)
        if i or config.norm.first_attention:
            modules.append((hf + "attn_norm", (*ours, "attention_norm"), "norm"))
        modules += [(hf + "attn.Wo", (*ours, "attention", "out"), "linear"),
                    (hf + "mlp_norm", (*ours, "mlp_norm"), "norm"),
                    (hf + "mlp.Wo", (*ours, "mlp", "down"), "linear")]
    mlm = [("head.dense", ("mlm_transform",), "linear"), ("head.norm", ("mlm_norm",), "norm")]
    return {"encoder": _expand(modules, config),
            "masked-LM": [*_expand(mlm, config), ("decoder.bias", ("mlm_bias",), False)]}


def fused_tensors(config: EncoderConfig) -> dict[str, tuple[tuple[Path, ...], tuple[int, ...]]]:
    """Fused tensor name (without `model.`) -> (the tfx parameters it stacks by rows, in order;
    their rows in it): each layer's Wqkv (queries, keys, values) and Wi (the activated input,
    tfx's gate, then up), weights and, with use_bias, biases."""
    width, f = config.d_model, config.d_ff
    out = {}
    for i in range(config.num_layers):
        hf, ours = f"layers.{i}.", ("stack", "layers", i)
        fused = {"attn.Wqkv": ((*ours, "attention"), ("query", "key", "value"), (width,) * 3),
                 "mlp.Wi": ((*ours, "mlp"), ("gate", "up"), (f, f))}
        for name, (module, parts, rows) in fused.items():
            for hf_param, ours_param, _ in _KINDS["linear"][:1 + config.use_bias]:
                out[f"{hf}{name}.{hf_param}"] = (
                    tuple((*module, part, ours_param) for part in parts), rows)
    return out


def _split_rows(name: str, rows: tuple[int, ...], value: np.ndarray) -> tuple[np.ndarray, ...]:
    """A fused nn.Linear weight [sum(rows), d] -> one kernel [d, n] per n in `rows` (a bias
    [sum(rows)] -> one bias [n] each)."""
    if value.shape[0] != sum(rows):
        raise ValueError(f"tensor {name!r} has shape {value.shape}, expected {sum(rows)} rows "
                         f"({' + '.join(map(str, rows))})")
    return tuple(part.T for part in np.split(value, np.cumsum(rows)[:-1]))


def _expand(modules, config: EncoderConfig) -> list[tuple[str, Path, bool]]:
    """Module entries -> tensor entries: weights, and biases where the config has them."""
    out = []
    for name, path, kind in modules:
        has_bias = {"linear": config.use_bias, "norm": config.norm.bias}.get(kind, False)
        out += [(f"{name}.{hf}", (*path, ours), transpose)
                for hf, ours, transpose in _KINDS[kind] if hf == "weight" or has_bias]
    return out


def _full(prefix: str, name: str) -> str:
    """The checkpoint's name of a tensor: the encoder's under `prefix`, the head's as is."""
    return name if name.startswith(("head.", "decoder.")) else prefix + name
