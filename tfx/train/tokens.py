"""Tokens: the tokenizers (bytes, or a Hugging Face `tokenizers` file), the special tokens of
the byte-level vocabularies, and the token stream that training batches are windows of.

Every batch is a pure function of `(seed, step)` (`np.random.default_rng([seed, step])`), so a run
resumed from a checkpoint at step k sees exactly the batches an uninterrupted run sees, and no data
iterator state needs saving. Batches are cut from one concatenated token array with numpy
indexing on the host (no Python loop over tokens).

The texts themselves, `load_tokenizer` and `load_corpus` are `tfx.train.data`'s.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import tokenizers

__all__ = ["MLM_SPECIALS", "SEQ2SEQ_SPECIALS", "ByteTokenizer", "HFTokenizer", "Text",
           "TokenStream", "Tokenizer"]

Text = tuple[str, str]  # (relative path, text)

# Byte-level vocabularies: ids 0..255 are bytes, these special tokens follow in order (256, ...).
MLM_SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")  # BERT's masked LM (tfx.train.feed)
SEQ2SEQ_SPECIALS = ("[PAD]", "[BOS]", "[EOS]")  # the synthetic tasks (tfx.train.tasks)


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
