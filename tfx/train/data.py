"""Text data for language-model training: tokenizers, the corpus, and deterministic batches.

Every batch is a pure function of `(seed, step)` (`np.random.default_rng([seed, step])`), so a run
resumed from a checkpoint at step k sees exactly the batches an uninterrupted run sees, and no data
iterator state needs saving. Batches are cut from one concatenated token array with numpy
indexing on the host (no Python loop over tokens).

A text is a `(relative_path, text)` pair; the relative path names it in splits and messages.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sysconfig
import warnings
import zlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import tokenizers

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
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

Text = tuple[str, str]  # (relative path, text)

# The embedded corpus: the standard library's own modules, without its test suites, generated
# tables (encodings' charmaps, pydoc's topic dump), bundled wheels and build-specific files.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                              "encodings", "pydoc_data", "ensurepip", "lib-dynload",
                              "__pycache__"})
STDLIB_MAX_BYTES = 8 * 2**20


class Tokenizer(Protocol):
    """What the training code needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> np.ndarray: ...
    def decode(self, ids) -> str: ...
    def token_id(self, name: str) -> int: ...


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, `specials` get ids 256, 257, ... in order.

    `encode` never produces special ids (the text "[PAD]" is five bytes); callers insert them.
    """

    specials: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.specials, tuple) or not all(
                isinstance(s, str) and s for s in self.specials):
            raise TypeError(f"specials must be a tuple of non-empty strings, got {self.specials!r}")
        if len(set(self.specials)) != len(self.specials):
            raise ValueError(f"specials must be distinct, got {self.specials!r}")

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.specials)

    def encode(self, text: str) -> np.ndarray:
        """str -> int32 [num_bytes]."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        """int ids of any shape (flattened) -> str; special ids are skipped, invalid UTF-8 is
        replaced by U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            return ""
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got values in "
                             f"[{ids.min()}, {ids.max()}]")
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def token_id(self, name: str) -> int:
        if name not in self.specials:
            raise ValueError(f"unknown special token {name!r}; this tokenizer has {self.specials}")
        return 256 + self.specials.index(name)


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (`path` is the file or a folder holding
    `tokenizer.json`) behind the `ByteTokenizer` interface. No special tokens are added by
    `encode`; `decode` skips them."""

    def __init__(self, path: str | os.PathLike):
        given = pathlib.Path(path)
        file = given / "tokenizer.json" if given.is_dir() else given
        if not file.is_file():
            raise ValueError(f"tokenizer path {str(path)!r}: no tokenizer file at {str(file)!r}")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception for bad JSON
            raise ValueError(f"tokenizer path {str(path)!r}: {str(file)!r} is not a readable "
                             f"tokenizers JSON file ({err})") from err
        self.path = file

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        """str -> int32 [num_tokens]."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        """int ids of any shape (flattened) -> str, special tokens skipped."""
        ids = np.asarray(ids).reshape(-1)
        return self._tokenizer.decode(ids.astype(np.int64).tolist(), skip_special_tokens=True)

    def token_id(self, name: str) -> int:
        token = self._tokenizer.token_to_id(name)
        if token is None:
            raise ValueError(f"unknown special token {name!r} for {self!r}")
        return token


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
        # A transformers tokenizer folder: its special tokens and chat template come along.
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
# Token streams and batches


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenStream:
    """Texts encoded and concatenated into one 1-D token array (uint8 for byte vocabularies,
    uint16 up to 65536 ids, else int32); batches are windows into it, returned as int32."""

    tokens: np.ndarray

    def __post_init__(self):
        if not isinstance(self.tokens, np.ndarray) or self.tokens.ndim != 1 or not np.issubdtype(
                self.tokens.dtype, np.integer):
            raise TypeError(f"tokens must be a 1-D integer numpy array, got {self.tokens!r}")

    @classmethod
    def from_texts(cls, texts: Sequence[Text], tokenizer: Tokenizer, *,
                   separator: str = "\n\n") -> TokenStream:
        """Encode each text and join them with the encoded `separator`."""
        sep = tokenizer.encode(separator)
        parts = []
        for i, (_, text) in enumerate(texts):
            if i:
                parts.append(sep)
            parts.append(tokenizer.encode(text))
        vocab = tokenizer.vocab_size
        dtype = np.uint8 if vocab <= 2**8 else np.uint16 if vocab <= 2**16 else np.int32
        return cls(np.concatenate(parts or [np.zeros(0, np.int32)]).astype(dtype))

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """int [N] start offsets -> int32 [N, width]: `tokens[start : start + width]` per row."""
        if len(self) < width:
            raise ValueError(f"seq_len: the stream holds {len(self)} tokens, fewer than the "
                             f"{width} one window needs; use a shorter seq_len or more text")
        return self.tokens[np.asarray(starts)[:, None] + np.arange(width)].astype(np.int32)

    def batch_starts(self, step: int, batch_size: int, seq_len: int, *, seed: int) -> np.ndarray:
        """int64 [batch_size]: the window starts of training batch `step`, drawn from
        `default_rng([seed, step])`."""
        step, seed = _check_int("step", step, 0), _check_int("seed", seed, 0)
        batch_size = _check_int("batch_size", batch_size, 1)
        width = _check_int("seq_len", seq_len, 1) + 1
        rng = np.random.default_rng([seed, step])
        return rng.integers(0, max(len(self) - width, 0) + 1, batch_size)

    def batch(self, step: int, batch_size: int, seq_len: int, *, seed: int,
              rows: tuple[int, int] | None = None) -> np.ndarray:
        """Random windows for training step `step`: int32 [batch_size, seq_len + 1] (inputs are
        `[:, :-1]`, next-token targets `[:, 1:]`). The same (seed, step) gives the same batch.
        With `rows=(start, stop)`, only those rows [stop - start, seq_len + 1], and only their
        windows are read: each process of a multi-process run reads its own
        (`tfx.parallel.process_row_range`)."""
        starts = self.batch_starts(step, batch_size, seq_len, seed=seed)
        if rows is not None:
            if not 0 <= rows[0] <= rows[1] <= batch_size:
                raise ValueError(f"rows must be (start, stop) with 0 <= start <= stop <= "
                                 f"batch_size ({batch_size}), got {rows}")
            starts = starts[rows[0]:rows[1]]
        return self.windows(starts, seq_len + 1)

    def eval_batches(self, num_batches: int, batch_size: int, seq_len: int) -> list[np.ndarray]:
        """`num_batches` int32 [batch_size, seq_len + 1] batches of evenly spaced windows, the
        first at the start of the stream and the last ending at its end (no randomness)."""
        num_batches = _check_int("num_batches", num_batches, 1)
        batch_size = _check_int("batch_size", batch_size, 1)
        width = _check_int("seq_len", seq_len, 1) + 1
        starts = np.linspace(0, max(len(self) - width, 0), num_batches * batch_size)
        windows = self.windows(np.round(starts).astype(np.int64), width)
        return list(windows.reshape(num_batches, batch_size, width))


def corpus_texts(data: str | os.PathLike | None) -> list[Text]:
    """The texts of `data`: None or "stdlib" for `stdlib_texts()`, else a file or folder for
    `text_files` (write "./stdlib" for a folder of that name)."""
    return stdlib_texts() if data is None or data == "stdlib" else text_files(data)


def load_corpus(data: str | os.PathLike | None, tokenizer: Tokenizer, *,
                val_fraction: float = 0.05) -> tuple[TokenStream, TokenStream]:
    """(train, val) token streams of `corpus_texts(data)`; or, when `data` is a folder of token
    shards (`tfx.train.shards`: it holds their manifest), its memory-mapped `ShardStream`s,
    which have the same interface and were split when tokenized (`val_fraction` unused)."""
    from tfx.train import shards  # here, not at the top: shards imports this module

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
