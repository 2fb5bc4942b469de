"""T5 checkpoints (T5ForConditionalGeneration: T5 1.0, T5 v1.1, Flan-T5) <-> tfx EncoderDecoder.

T5 (its card: `tfx.models.families.T5`) is a pre-norm encoder–decoder with RMS norms
("T5LayerNorm"), no biases, unscaled attention scores and a learned relative position bias
whose table lives only in block 0 of each stack (bidirectional buckets in the encoder, causal
ones in the decoder) and is reused by every layer; tfx's `Stack` owns that table
(`relative_bias`). Cross-attention has no position bias.

The output head: T5 1.0 ties it to the shared embeddings and scales the decoder output by
d_model**-0.5; v1.1 / Flan have a separate `lm_head` and no scaling. transformers 5 always ties
the two in its config (`tie_word_embeddings` is forced to True) and records the scaling as
`scale_decoder_outputs`, keeping a separate `lm_head.weight` in the file when it differs. In
every T5 release tied ⇔ scaled, so tfx reads the head's kind from the scaling flag, and fills an
untied head from `shared.weight` when the file omits `lm_head.weight` (transformers ties them).
"""

from __future__ import annotations

import numpy as np

from tfx.hf import plan
from tfx.hf.decoder_parts import check_card
from tfx.models import families
from tfx.models.config import EncoderDecoderConfig

__all__ = ["ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
           "params_from_hf", "params_to_hf", "steps"]

ARCHITECTURES = ("T5ForConditionalGeneration",)
OPTIONAL_PARAMS: tuple = ()  # every parameter must come from the checkpoint
CARD = families.T5  # what every T5 is: set on load, checked on save
# T5Config's defaults, for config.json files that leave a field out.
_DEFAULTS = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6,
                 num_decoder_layers=None, num_heads=8, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
                 feed_forward_proj="relu", pad_token_id=0, decoder_start_token_id=None,
                 tie_encoder_decoder=False)

# transformers' activation names (T5's `dense_act_fn`) -> tfx's. "gated-gelu" means gelu_new.
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}
_HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}

# NNX lists the embedding table shared by both Embeddings modules under its first path in
# attribute order; the head's path when untied.
_SHARED = ("decoder_embeddings", "tokens", "table")
_HEAD = ("head", "kernel")
# A tensor transformers itself ignores when loading: an unused cross-attention bias table.
IGNORED = (r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",)
# Copies of the shared embeddings older checkpoints hold; transformers ties them to shared.weight.
_EMBED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")

Path = tuple[str | int, ...]


def config_from_hf(hf: dict, architecture: str) -> EncoderDecoderConfig:
    """A T5 config.json (as a dict) -> EncoderDecoderConfig, a model of the card; dropout off
    (HF in eval mode)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    hf = {**_DEFAULTS, **hf}
    if hf["tie_encoder_decoder"]:
        raise ValueError("tie_encoder_decoder=True (encoder and decoder sharing weights) is not "
                         "supported by tfx")
    activation, gated = _activation(hf)
    # transformers 4 wrote only tie_word_embeddings; 5 writes scale_decoder_outputs too.
    scaled = hf.get("scale_decoder_outputs")
    if scaled is None:
        scaled = hf.get("tie_word_embeddings") is not False
    start = hf["decoder_start_token_id"]
    start = hf["pad_token_id"] if start is None else start  # T5 starts with the pad token
    return CARD.config({
        "vocab_size": hf["vocab_size"], "d_model": hf["d_model"], "num_layers": hf["num_layers"],
        "num_decoder_layers": hf["num_decoder_layers"] or hf["num_layers"],
        "num_heads": hf["num_heads"], "d_ff": hf["d_ff"],
        "t5.num_buckets": hf["relative_attention_num_buckets"],
        "t5.max_distance": hf["relative_attention_max_distance"],
        "attention.head_dim": hf["d_kv"], "mlp.activation": activation, "mlp.gated": gated,
        "norm.eps": hf["layer_norm_epsilon"], "embeddings.tie": bool(scaled),
        "embeddings.pad_id": hf["pad_token_id"], "scale_tied_head": bool(scaled),
        "decoder_start_token_id": start or 0, "dropout": 0.0})


def _activation(hf: dict) -> tuple[str, bool]:
    """(tfx activation, gated) from feed_forward_proj ("relu", "gated-gelu", ...); the
    `dense_act_fn` / `is_gated_act` that transformers saves beside it take precedence, as there."""
    proj = hf["feed_forward_proj"]
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ValueError(f"feed_forward_proj must be 'ACT' or 'gated-ACT', got {proj!r}")
    name = hf.get("dense_act_fn") or ("gelu_new" if proj == "gated-gelu" else parts[-1])
    gated = hf.get("is_gated_act", parts[0] == "gated")
    if name not in _ACTIVATIONS:
        raise ValueError(f"feed_forward_proj {proj!r} (dense_act_fn {name!r}) is not supported; "
                         f"tfx supports the activations {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name], bool(gated)


def config_to_hf(config: EncoderDecoderConfig, architecture: str) -> dict:
    """EncoderDecoderConfig -> T5 config.json dict; ValueError naming each field of what T5
    cannot express (a model not of the card)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    check_card(config, architecture, CARD)
    c = config
    if c.mlp.activation not in _HF_ACTIVATIONS:
        raise ValueError(f"mlp.activation {c.mlp.activation!r} has no T5 feed_forward_proj")
    act = _HF_ACTIVATIONS[c.mlp.activation]
    # transformers reads "gated-gelu" as gelu_new (tanh), kept for old checkpoints' sake.
    proj = ("gated-gelu" if act == "gelu_new" else f"gated-{act}") if c.mlp.gated else act
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
        "vocab_size": c.vocab_size, "d_model": c.d_model,
        "d_kv": c.attention.head_dim or c.d_model // c.num_heads, "d_ff": c.d_ff,
        "num_layers": c.num_layers,
        "num_decoder_layers": c.decoder_layers, "num_heads": c.num_heads,
        "relative_attention_num_buckets": c.t5.num_buckets,
        "relative_attention_max_distance": c.t5.max_distance, "dropout_rate": c.dropout,
        "layer_norm_epsilon": c.norm.eps, "feed_forward_proj": proj, "dense_act_fn": act,
        "is_gated_act": c.mlp.gated, "is_encoder_decoder": True,
        "tie_word_embeddings": c.embeddings.tie,
        "scale_decoder_outputs": c.embeddings.tie and c.scale_tied_head,
        "decoder_start_token_id": c.decoder_start_token_id,
        "pad_token_id": 0 if c.embeddings.pad_id is None else c.embeddings.pad_id,
        "eos_token_id": 1,
    }


def _names(config: EncoderDecoderConfig) -> list[tuple[Path, str, bool]]:
    """(tfx path, HF tensor name, transposed) for every parameter except the embeddings and
    the head. torch Linear weights are [out, in], nnx kernels [in, out]: transposed."""
    mlp = (("gate", "wi_0"), ("up", "wi_1")) if config.mlp.gated else (("up", "wi"),)
    mlp += (("down", "wo"),)
    projections = (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))
    names = []
    for stack, count in (("encoder", config.num_layers), ("decoder", config.decoder_layers)):
        names += [((stack, "relative_bias", "table"),
                   f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", False),
                  ((stack, "final_norm", "scale"), f"{stack}.final_layer_norm.weight", False)]
        # T5Block.layer: [self-attention, (cross-attention,) feed-forward], each with its norm.
        attentions = [("attention", "attention_norm", "SelfAttention")]
        if stack == "decoder":
            attentions.append(("cross_attention", "cross_norm", "EncDecAttention"))
        for i in range(count):
            ours, theirs = (stack, "layers", i), f"{stack}.block.{i}.layer"
            for j, (attention, norm, hf_attention) in enumerate(attentions):
                names += [((*ours, attention, a, "kernel"),
                           f"{theirs}.{j}.{hf_attention}.{b}.weight", True) for a, b in projections]
                names.append(((*ours, norm, "scale"), f"{theirs}.{j}.layer_norm.weight", False))
            ff = len(attentions)
            names += [((*ours, "mlp", a, "kernel"), f"{theirs}.{ff}.DenseReluDense.{b}.weight",
                       True) for a, b in mlp]
            names.append(((*ours, "mlp_norm", "scale"), f"{theirs}.{ff}.layer_norm.weight", False))
    return names


def params_from_hf(tensors: dict[str, np.ndarray],
                   config: EncoderDecoderConfig) -> dict[Path, np.ndarray]:
    """HF tensors by name -> tfx parameters by state path. Every tensor must be used (or be one
    transformers ignores too), so nothing that changes the numbers is dropped silently."""
    return plan.convert(steps(tensors.keys(), config), tensors, ignored=IGNORED)


def steps(names, config: EncoderDecoderConfig) -> list[plan.Step]:
    """The conversion plan for a checkpoint holding tensors `names` (see `tfx.hf.plan`). The
    embedding copies and a tied lm_head are checked to equal the shared table; an untied head
    without lm_head.weight is the shared table (transformers ties them)."""
    out = [plan.copy(path, name, transpose=transposed) for path, name, transposed in _names(config)]
    shared = "shared.weight"
    if shared not in names and _EMBED_COPIES[0] in names:  # some old checkpoints' only copy
        shared = _EMBED_COPIES[0]
    out.append(plan.copy(_SHARED, shared))
    out += [plan.tied(copy, shared) for copy in _EMBED_COPIES if copy != shared and copy in names]
    if not config.embeddings.tie:
        head = "lm_head.weight" if "lm_head.weight" in names else shared
        out.append(plan.copy(_HEAD, head, transpose=True))
    elif "lm_head.weight" in names:
        out.append(plan.tied("lm_head.weight", shared, "scale_decoder_outputs / "
                             "tie_word_embeddings"))
    return out


def params_to_hf(params: dict[Path, np.ndarray],
                 config: EncoderDecoderConfig) -> dict[str, np.ndarray]:
    """tfx parameters by state path -> HF tensors by name (the inverse of params_from_hf)."""
    tensors = {name: _oriented(params[path], transposed)
               for path, name, transposed in _names(config)}
    tensors["shared.weight"] = np.asarray(params[_SHARED])
    if not config.embeddings.tie:
        tensors["lm_head.weight"] = np.asarray(params[_HEAD]).T
    return tensors


def _oriented(array, transposed: bool) -> np.ndarray:
    array = np.asarray(array)
    return array.T if transposed else array
