"""Text data for language-model training: the corpus, its split, loading a tokenizer and a
corpus, and BERT's pretraining rows. The tokenizers and token streams are `tfx.train.tokens`'s
(re-exported here); a folder of token shards is `tfx.train.shards`'s.

A text is a `(relative_path, text)` pair; the relative path names it in splits and messages.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
import warnings
import zlib
from collections.abc import Sequence

import numpy as np

from tfx.train import shards
from tfx.train.tokens import (
    ByteTokenizer,
    HFTokenizer,
    Text,
    Tokenizer,
    TokenStream,
    _check_int,
)

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Text",
    "TokenStream",
    "Tokenizer",
    "corpus_texts",
    "load_corpus",
    "load_tokenizer",
    "mlm_batch",
    "split_texts",
    "stdlib_texts",
    "text_files",
]

# The embedded corpus: the standard library's own modules, without its test suites, generated
# tables (encodings' charmaps, pydoc's topic dump), bundled wheels and build-specific files.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                              "encodings", "pydoc_data", "ensurepip", "lib-dynload",
                              "__pycache__"})
STDLIB_MAX_BYTES = 8 * 2**20


def load_tokenizer(spec: str | os.PathLike, *, specials: Sequence[str] = ()) -> Tokenizer:
    """"byte" -> `ByteTokenizer(specials)`; a transformers tokenizer folder (it holds
    tokenizer_config.json) -> `tfx.train.chat.ChatTokenizer`; anything else is a path for
    `HFTokenizer`. The tokenizer must already define every name in `specials` (ValueError
    otherwise)."""
    if spec == "byte":
        return ByteTokenizer(tuple(specials))
    if not isinstance(spec, str | os.PathLike):
        raise TypeError(f"tokenizer must be 'byte' or a path, got {spec!r}")
    if isinstance(spec, str) and not spec.strip():  # pathlib would read "" as "."
        raise ValueError(f"tokenizer must be 'byte' or a path, got {spec!r}")
    if (pathlib.Path(spec) / "tokenizer_config.json").is_file():
        # A transformers tokenizer folder: its special tokens and chat template come along
        # (and jinja2, for that template, loads only then).
        from tfx.train.chat import ChatTokenizer

        tokenizer = ChatTokenizer(spec)
    else:
        tokenizer = HFTokenizer(spec)
    for name in specials:
        tokenizer.token_id(name)
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Texts


def _files_under(root: pathlib.Path, skip_dir) -> list[tuple[str, pathlib.Path]]:
    """(relative posix path, path) of the files under `root`, sorted by relative path."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not skip_dir(d)]
        for name in files:
            path = pathlib.Path(folder, name)
            found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _decode(raw: bytes) -> tuple[str | None, str]:
    """(UTF-8 text, "") or (None, why not: "binary", "not UTF-8" or "blank")."""
    if b"\0" in raw:
        return None, "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    return (text, "") if text.strip() else (None, "blank")


def stdlib_texts(max_bytes: int = STDLIB_MAX_BYTES) -> list[Text]:
    """The Python standard library's own `.py` modules (no test suites, site-packages, generated
    tables), sorted by relative path and cut off before the file that would pass `max_bytes` of
    UTF-8 in total. About 8 MB by default, read in well under a second."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for rel, path in _files_under(root, lambda d: d in STDLIB_SKIP_DIRS or d.startswith(
            ("config-", "."))):
        if not rel.endswith(".py") or path.name.startswith("_sysconfigdata"):
            continue
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        text, _ = _decode(raw)
        if text is None:
            continue
        if total + len(raw) > max_bytes:
            break
        texts.append((rel, text))
        total += len(raw)
    return texts


def text_files(path: str | os.PathLike) -> list[Text]:
    """One text file, or every UTF-8 text file under a folder (recursively, sorted by relative
    path; hidden files and folders and `__pycache__` are left out).

    Files of a folder that are binary, not UTF-8, blank or unreadable are skipped, and a
    UserWarning says how many of each, with an example path.

    Raises:
      ValueError: naming `data` when the path is empty, missing or unreadable or yields no
        text.
    """
    if isinstance(path, str) and not path.strip():  # pathlib would read "" as "."
        raise ValueError(f"data: the path must not be empty, got {path!r}")
    root = pathlib.Path(path)
    if root.is_file():
        candidates = [(root.name, root)]
    elif root.is_dir():
        candidates = [(rel, p) for rel, p in _files_under(
            root, lambda d: d.startswith(".") or d == "__pycache__")
            if not p.name.startswith(".")]
    else:
        raise ValueError(f"data: {str(path)!r} does not exist")
    texts, skipped = [], {}  # skipped: reason -> relative paths
    for rel, file in candidates:
        try:
            text, reason = _decode(file.read_bytes())
        except OSError as err:
            if root.is_file():
                raise ValueError(f"data: cannot read {str(path)!r} ({err})") from err
            text, reason = None, "unreadable"
        if text is None:
            skipped.setdefault(reason, []).append(rel)
        else:
            texts.append((rel, text))
    summary = ", ".join(f"{len(rels)} {reason} (e.g. {rels[0]!r})"
                        for reason, rels in sorted(skipped.items()))
    if not texts:
        raise ValueError(f"data: {str(path)!r} holds no UTF-8 text ({summary or 'no files'})")
    if skipped:
        warnings.warn(f"data: skipped {len(candidates) - len(texts)} of {len(candidates)} files "
                      f"in {str(path)!r}: {summary}", UserWarning, stacklevel=2)
    return texts


def split_texts(texts: Sequence[Text], val_fraction: float = 0.05) -> tuple[list[Text],
                                                                             list[Text]]:
    """Split into (train, val), both non-empty, independent of file order and machine.

    The `max(1, round(val_fraction · n))` texts with the smallest `zlib.crc32` of their relative
    path go to val, so a text keeps its side from run to run. A lone text is instead cut at the
    first line break after `(1 - val_fraction)` of its characters (nanoGPT's split of one file).
    Both lists keep the input order.

    Raises:
      ValueError: naming `val_fraction` when it is not in (0, 1) or leaves a side empty.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if not texts:
        raise ValueError("texts must not be empty")
    if len(texts) == 1:
        (rel, text), = texts
        cut = int(len(text) * (1.0 - val_fraction))
        newline = text.find("\n", cut)
        cut = newline + 1 if newline != -1 else cut
        train, val = text[:cut], text[cut:]
        if not train or not val:
            raise ValueError(f"val_fraction={val_fraction} leaves the train or val part of the "
                             f"only text {rel!r} ({len(text)} characters) empty")
        return [(rel, train)], [(rel, val)]
    n = len(texts)
    num_val = max(1, round(val_fraction * n))
    if num_val >= n:
        raise ValueError(f"val_fraction={val_fraction} of {n} texts leaves no training text")
    by_hash = sorted(range(n), key=lambda i: (zlib.crc32(texts[i][0].encode()), texts[i][0]))
    is_val = np.zeros(n, bool)
    is_val[by_hash[:num_val]] = True
    return ([t for t, v in zip(texts, is_val, strict=True) if not v],
            [t for t, v in zip(texts, is_val, strict=True) if v])


# ---------------------------------------------------------------------------------------------
# Corpora and batches


def corpus_texts(data: str | os.PathLike | None) -> list[Text]:
    """The texts of `data`: None or "stdlib" for `stdlib_texts()`, else a file or folder for
    `text_files` (write "./stdlib" for a folder of that name)."""
    return stdlib_texts() if data is None or data == "stdlib" else text_files(data)


def load_corpus(data: str | os.PathLike | None, tokenizer: Tokenizer, *,
                val_fraction: float = 0.05) -> tuple[TokenStream, TokenStream]:
    """(train, val) token streams of `corpus_texts(data)`; or, when `data` is a folder of token
    shards (`tfx.train.shards`: it holds their manifest), its memory-mapped `ShardStream`s,
    which have the same interface and were split when tokenized (`val_fraction` unused)."""
    if shards.is_shard_folder(data):
        return shards.load_shard_corpus(data, tokenizer, val_fraction=val_fraction)
    train, val = split_texts(corpus_texts(data), val_fraction)
    return TokenStream.from_texts(train, tokenizer), TokenStream.from_texts(val, tokenizer)


def mlm_batch(stream: TokenStream, step: int, batch_size: int, seq_len: int, *, seed: int,
              cls_id: int, sep_id: int, pad_id: int) -> dict[str, np.ndarray]:
    """BERT pretraining rows `[CLS] text [SEP] [PAD] ...` for step `step` (masking comes later,
    on the device: `tfx.train.masking.mask_tokens`).

    Each row's text is a random window of the stream whose length is drawn uniformly from
    [seq_len // 2, seq_len - 2], so the model sees padding; all from `default_rng([seed, step])`.

    Returns:
      {"input_ids": int32 [batch_size, seq_len], "attention_mask": bool [batch_size, seq_len]
        (True on CLS, text and SEP)}.
    """
    step, seed = _check_int("step", step, 0), _check_int("seed", seed, 0)
    batch_size = _check_int("batch_size", batch_size, 1)
    seq_len = _check_int("seq_len", seq_len, 4)
    for name, value in (("cls_id", cls_id), ("sep_id", sep_id), ("pad_id", pad_id)):
        _check_int(name, value, 0)
    max_text = seq_len - 2
    rng = np.random.default_rng([seed, step])
    lengths = rng.integers(seq_len // 2, max_text + 1, batch_size)[:, None]
    text = stream.windows(rng.integers(0, max(len(stream) - max_text, 0) + 1, batch_size),
                          max_text)
    col = np.arange(seq_len)
    body = np.pad(text, ((0, 0), (1, 1)))  # text in columns 1 .. seq_len - 2
    input_ids = np.where(col == 0, cls_id, np.where(col <= lengths, body, np.where(
        col == lengths + 1, sep_id, pad_id))).astype(np.int32)
    return {"input_ids": input_ids, "attention_mask": col <= lengths + 1}
