"""BERT checkpoints (BertModel, BertForMaskedLM) <-> `tfx.models.Encoder`.

What every BERT is (post-norm LayerNorm, learned positions and token types, biases) lives in its
card, `tfx.models.families.BERT`; this module reads the sizes from config.json, checks a model
against the card before a save, and maps the tensors.

The tfx Encoder always carries BERT's two heads: the [CLS] pooler (`model.pooled(hidden)`, HF's
`pooler_output`) and the masked-LM head (`model.mlm_logits(hidden)`, HF BertForMaskedLM's
logits). Its call is BertModel's: `model(input_ids, attention_mask=, token_type_ids=)` -> float32
last hidden state [batch, seq, hidden]. Both architectures load into the same Encoder:

- BertModel: weights named `embeddings.*`, `encoder.*`, `pooler.*`.
- BertForMaskedLM: the same under `bert.` (no pooler), plus the head `cls.predictions.*`; the
  decoder weight and bias are tied to the word embeddings and `cls.predictions.bias`.

Heads a checkpoint lacks: the encoder (embeddings and layers) must be complete, but each head
(pooler; MLM head) is loaded only when the checkpoint has tensors for it, and must then be
complete. A head with no tensors at all keeps the model's initial (random, seed 0) values, as
transformers does for missing heads: they never affect the hidden states, but `pooled` or
`mlm_logits` then mean nothing until trained. `OPTIONAL_PARAMS` tells `tfx.hf.load` which
parameters may be absent. Tensors that nothing reads raise an error (e.g. BertForPreTraining's
next-sentence head, which the Encoder has no place for), except the position/token-type buffers
older transformers saved (`IGNORED`) and the tied decoder copies (checked to really be tied).

Saving: `params_to_hf` is not told the architecture, so it writes every parameter of the Encoder
under BertModel's names plus `cls.predictions.*`; transformers' BertModel loads the encoder and
pooler from it (reporting cls.* as unused) and BertForMaskedLM the encoder and MLM head
(reporting the pooler as unused).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from tfx.hf import plan
from tfx.hf.decoder_parts import check_card
from tfx.models import families
from tfx.models.config import EncoderConfig

__all__ = ["ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
           "encoder_copies", "params_from_hf", "params_to_hf", "steps", "tensor_table"]

ARCHITECTURES = ("BertModel", "BertForMaskedLM")
# Heads that a checkpoint may lack (path prefixes in the Encoder); see the module docstring.
OPTIONAL_PARAMS = (("pooler",), ("mlm_transform",), ("mlm_norm",), ("mlm_bias",))
CARD = families.BERT  # what every BERT is: set on load, checked on save
# BertConfig's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, hidden_act="gelu", max_position_embeddings=512,
                 type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0,
                 position_embedding_type="absolute", is_decoder=False, add_cross_attention=False,
                 tie_word_embeddings=True)

Path = tuple[str | int, ...]

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu"}
# tanh-GELU is written "gelu_new", as the GPT-2 and T5 exports do (torch's fused
# "gelu_pytorch_tanh" differs from it in the last bit).
_ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu",
                      "silu": "silu"}
# Saved by older transformers as (non-persistent today) int64 buffers: constants, not weights;
# transformers ignores them too.
IGNORED = (r"(bert\.)?embeddings\.(position_ids|token_type_ids)",)
# The masked-LM decoder's tensors, tied to these (names without `bert.`).
_TIED = {"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",
         "cls.predictions.decoder.bias": "cls.predictions.bias"}
# Tensor names of each kind of torch module, and whether the weight is transposed:
# torch nn.Linear stores [out, in], nnx.Linear [in, out].
_KINDS = {
    "linear": (("weight", "kernel", True), ("bias", "bias", False)),
    "norm": (("weight", "scale", False), ("bias", "bias", False)),
    "embedding": (("weight", "table", False),),
}


def config_from_hf(hf: dict, architecture: str) -> EncoderConfig:
    """BertConfig fields (config.json as a dict) -> EncoderConfig, a model of the card (BERT:
    post-norm, learned positions, biases); dropout off. Settings tfx cannot honour raise
    ValueError naming the field."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    hf = {**_DEFAULTS, **hf}
    position = hf["position_embedding_type"]
    if position != "absolute":
        raise ValueError(f"position_embedding_type={position!r} is not supported; tfx loads "
                         "BERT with 'absolute' (learned) position embeddings only")
    for field in ("is_decoder", "add_cross_attention"):
        if hf[field]:
            raise ValueError(f"{field}=True is not supported: tfx loads BERT as a "
                             "bidirectional encoder without cross-attention")
    if architecture == "BertForMaskedLM" and not hf["tie_word_embeddings"]:
        raise ValueError("tie_word_embeddings=False is not supported: the tfx masked-LM head "
                         "reuses the word embeddings")
    act = hf["hidden_act"]
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported; tfx maps {sorted(_ACTIVATIONS)}")
    pad = hf["pad_token_id"]
    return CARD.config({
        "vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"], "num_heads": hf["num_attention_heads"],
        "d_ff": hf["intermediate_size"], "max_len": hf["max_position_embeddings"],
        "type_vocab_size": hf["type_vocab_size"], "norm.eps": hf["layer_norm_eps"],
        "mlp.activation": _ACTIVATIONS[act], "special_tokens.pad_id": 0 if pad is None else pad,
        "dropout": 0.0})


def config_to_hf(config: EncoderConfig, architecture: str) -> dict:
    """The BertConfig dict (config.json) of an EncoderConfig that BERT can express (a model of
    the card); ValueError naming each field it cannot."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    check_card(config, architecture, CARD)
    c = config
    if c.mlp.activation not in _ACTIVATIONS_TO_HF:
        raise ValueError(f"mlp.activation={c.mlp.activation!r} cannot be written as "
                         f"{architecture}; BERT takes {sorted(_ACTIVATIONS_TO_HF)}")
    return {
        "architectures": [architecture], "model_type": "bert",
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "intermediate_size": c.d_ff,
        "hidden_act": _ACTIVATIONS_TO_HF[c.mlp.activation],
        "max_position_embeddings": c.max_len, "type_vocab_size": c.type_vocab_size,
        "layer_norm_eps": c.norm.eps, "pad_token_id": c.special_tokens.pad_id,
        "position_embedding_type": "absolute", "tie_word_embeddings": True,
        # tfx drops out residual branches and embeddings, never attention probabilities.
        "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
    }


def params_from_hf(tensors: dict[str, np.ndarray], config: EncoderConfig) -> dict[Path, np.ndarray]:
    """BERT tensors (with or without the `bert.` prefix) -> Encoder parameters by state path
    (every tensor accounted for). Heads without any tensor are left out (they keep their
    initial values, `OPTIONAL_PARAMS`)."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: EncoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`): the
    encoder, each head that has any tensor in `names`, and the tied decoder copies present."""
    prefix = "bert." if any(name.startswith("bert.") for name in names) else ""
    out = encoder_copies(names, tensor_table(config), functools.partial(_full, prefix), "BERT")
    out += [plan.tied(copy, _full(prefix, source), "tfx supports the tied masked-LM decoder only")
            for copy, source in _TIED.items() if copy in names]
    return out


def encoder_copies(names, table: dict[str, list[tuple[str, Path, bool]]],
                   full: Callable[[str], str], family: str) -> list[plan.Step]:
    """The copy steps of an encoder checkpoint (BERT, ModernBERT): every tensor of the table's
    "encoder" group, which must all be present, and each other group (a head) whole when
    `names` holds any of its tensors, else none of it (the head keeps its initial values).

    Args:
      names: the checkpoint's tensor names (anything that answers `in`).
      table: group -> [(tensor name without the model's prefix, tfx path, transposed)], as
        `tensor_table` gives it.
      full: the checkpoint's name of a table name (the model's prefix added where it applies).
      family: the model's name, for the reason a step gives ("BERT").
    """
    out = []
    for group, entries in table.items():
        if group != "encoder" and not any(full(name) in names for name, _, _ in entries):
            continue
        why = (f"the {family} encoder needs it" if group == "encoder" else
               f"the {group} head's other tensors are present; a head loads whole or not at all")
        out += [plan.copy(path, full(name), transpose=transpose, why=why)
                for name, path, transpose in entries]
    return out


def params_to_hf(params: dict[Path, np.ndarray], config: EncoderConfig) -> dict[str, np.ndarray]:
    """Encoder parameters -> BertModel tensor names plus the `cls.predictions.*` head."""
    return {name: params[path].T if transpose else params[path]
            for entries in tensor_table(config).values() for name, path, transpose in entries}


def tensor_table(config: EncoderConfig) -> dict[str, list[tuple[str, Path, bool]]]:
    """(HF tensor name without `bert.`, tfx path, transposed) for each group of parameters:
    "encoder" (required), "pooler" and "masked-LM" (optional heads)."""
    modules = [("embeddings.word_embeddings", ("embeddings", "tokens"), "embedding"),
               ("embeddings.position_embeddings", ("embeddings", "positions"), "embedding"),
               ("embeddings.token_type_embeddings", ("embeddings", "token_types"), "embedding"),
               ("embeddings.LayerNorm", ("embeddings", "norm"), "norm")]
    for i in range(config.num_layers):
        hf, ours = f"encoder.layer.{i}.", ("stack", "layers", i)
        modules += [(hf + "attention.self.query", (*ours, "attention", "query"), "linear"),
                    (hf + "attention.self.key", (*ours, "attention", "key"), "linear"),
                    (hf + "attention.self.value", (*ours, "attention", "value"), "linear"),
                    (hf + "attention.output.dense", (*ours, "attention", "out"), "linear"),
                    (hf + "attention.output.LayerNorm", (*ours, "attention_norm"), "norm"),
                    (hf + "intermediate.dense", (*ours, "mlp", "up"), "linear"),
                    (hf + "output.dense", (*ours, "mlp", "down"), "linear"),
                    (hf + "output.LayerNorm", (*ours, "mlp_norm"), "norm")]
    mlm = [("cls.predictions.transform.dense", ("mlm_transform",), "linear"),
           ("cls.predictions.transform.LayerNorm", ("mlm_norm",), "norm")]
    return {"encoder": _expand(modules), "pooler": _expand([("pooler.dense", ("pooler",),
                                                            "linear")]),
            "masked-LM": [*_expand(mlm), ("cls.predictions.bias", ("mlm_bias",), False)]}


def _expand(modules) -> list[tuple[str, Path, bool]]:
    return [(f"{name}.{hf}", (*path, ours), transpose)
            for name, path, kind in modules for hf, ours, transpose in _KINDS[kind]]


def _full(prefix: str, name: str) -> str:
    return name if name.startswith("cls.") else prefix + name
