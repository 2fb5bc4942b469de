"""Synthetic sequence-to-sequence tasks for encoder–decoder experiments, generated on the fly.

- copy / reverse / sort: a string of `min_len..max_len` random lowercase letters -> itself, its
  reverse, its letters in sorted order.
- addition: "a+b" -> the decimal sum, where a and b together have `min_len..max_len` digits
  (`min_len >= 2`): the total is drawn uniformly, a's share uniformly from 1..total-1, and each
  number uniformly among those with that many digits (no leading zeros; one digit includes 0).
- addition_reversed: the same sums with the answer written least significant digit first, as
  Lee et al. 2023 (Teaching Arithmetic to Small Transformers) do: each answer digit then
  follows from two source digits and the carry just written, instead of from carries that an
  answer written most significant digit first has not yet produced.

Like `tfx.train.data`, a batch is a pure function of `(seed, step)`, built with numpy on the host,
and every batch has the same padded shapes, so the train step compiles once.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from tfx import names
from tfx.train.tokens import SEQ2SEQ_SPECIALS, ByteTokenizer, _check_int

__all__ = ["TASKS", "SyntheticTask"]

TASKS = names.TASKS
MAX_ADDITION_DIGITS = 18  # operands and sums stay far below int64's 9.2e18
_SUM = re.compile(r"(\d+)\+(\d+)")


def _reversed(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[B, W] rows whose first `lengths` [B] entries are kept -> those entries reversed (the
    rest is not meaningful)."""
    backwards = np.maximum(lengths[:, None] - 1 - np.arange(values.shape[1]), 0)
    return np.take_along_axis(values, backwards, axis=1)


def _digits(numbers: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 [B] non-negative -> (ASCII digits int64 [B, width] left-aligned and zero-padded on
    the right, number of digits int64 [B])."""
    lengths = 1 + (numbers[:, None] >= 10 ** np.arange(1, width, dtype=np.int64)).sum(1)
    power = np.maximum(lengths[:, None] - 1 - np.arange(width), 0)
    digits = numbers[:, None] // 10**power % 10 + ord("0")
    return np.where(np.arange(width) < lengths[:, None], digits, 0), lengths


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """One of `TASKS` with its byte tokenizer (specials [PAD], [BOS] (decoder start), [EOS]).

    Attributes:
      name: one of `TASKS`.
      min_len, max_len: letters per source string, or digits of a and b together for addition.
    """

    name: str
    min_len: int = 4
    max_len: int = 16
    tokenizer: ByteTokenizer = dataclasses.field(
        init=False, repr=False, default=ByteTokenizer(specials=SEQ2SEQ_SPECIALS))

    def __post_init__(self):
        if self.name not in TASKS:
            raise ValueError(f"name must be one of {TASKS}, got {self.name!r}")
        shortest = 2 if self.is_addition else 1
        _check_int("min_len", self.min_len, shortest)
        _check_int("max_len", self.max_len, self.min_len)
        if self.is_addition and self.max_len > MAX_ADDITION_DIGITS:
            raise ValueError(f"max_len must be <= {MAX_ADDITION_DIGITS} for addition, got "
                             f"{self.max_len}")

    @property
    def is_addition(self) -> bool:
        """Whether the sources are sums "a+b" (addition, addition_reversed)."""
        return self.name.startswith("addition")

    @property
    def pad_id(self) -> int:
        return self.tokenizer.token_id("[PAD]")

    @property
    def bos_id(self) -> int:
        return self.tokenizer.token_id("[BOS]")

    @property
    def eos_id(self) -> int:
        return self.tokenizer.token_id("[EOS]")

    @property
    def source_len(self) -> int:
        """Encoder positions S: the longest source ("a+b" has one more than its digits)."""
        return self.max_len + self.is_addition

    @property
    def target_len(self) -> int:
        """Decoder positions T: the longest answer (at most max_len characters) plus BOS/EOS."""
        return self.max_len + 1

    def answer(self, source_text: str) -> str:
        """The reference solution for one decoded source string."""
        if self.name == "copy":
            return source_text
        if self.name == "reverse":
            return source_text[::-1]
        if self.name == "sort":
            return "".join(sorted(source_text))
        match = _SUM.fullmatch(source_text)
        if match is None:
            raise ValueError(f"source_text must look like '12+345' for addition, got "
                             f"{source_text!r}")
        total = str(int(match[1]) + int(match[2]))
        return total[::-1] if self.name == "addition_reversed" else total

    def decode_target(self, ids) -> str:
        """Decoder output ids [T] (labels or generated tokens) -> text up to the first EOS."""
        ids = np.asarray(ids).reshape(-1)
        end = np.flatnonzero(ids == self.eos_id)
        return self.tokenizer.decode(ids[: end[0]] if end.size else ids)

    def batch(self, step: int, batch_size: int, *, seed: int) -> dict[str, np.ndarray]:
        """Examples for training step `step`; the same (seed, step) gives the same batch.

        Returns, with S = source_len and T = target_len:
          "input_ids" int32 [B, S] (source bytes, then PAD), "attention_mask" bool [B, S],
          "decoder_input_ids" int32 [B, T] (BOS, answer, PAD...), "labels" int32 [B, T]
          (answer, EOS, PAD...), "label_mask" bool [B, T] (True on answer and EOS).
        """
        step, seed = _check_int("step", step, 0), _check_int("seed", seed, 0)
        batch_size = _check_int("batch_size", batch_size, 1)
        rng = np.random.default_rng([seed, step])
        if self.is_addition:
            source, source_lengths, target, target_lengths = self._additions(rng, batch_size)
        else:
            source, source_lengths, target, target_lengths = self._letters(rng, batch_size)
        return self._pack(source, source_lengths, target, target_lengths)

    def _letters(self, rng: np.random.Generator, batch_size: int):
        lengths = rng.integers(self.min_len, self.max_len + 1, batch_size)
        letters = rng.integers(ord("a"), ord("z") + 1, (batch_size, self.max_len))
        col = np.arange(self.max_len)
        if self.name == "copy":
            target = letters
        elif self.name == "reverse":
            target = _reversed(letters, lengths)
        else:  # sort: padding as 255 sorts after every letter
            target = np.sort(np.where(col < lengths[:, None], letters, 255), axis=1)
        return letters, lengths, target, lengths

    def _additions(self, rng: np.random.Generator, batch_size: int):
        total = rng.integers(self.min_len, self.max_len + 1, batch_size)
        a_len = rng.integers(1, total)
        b_len = total - a_len
        numbers = [rng.integers(np.where(n == 1, 0, 10 ** (n - 1)), 10**n) for n in (a_len, b_len)]
        a, b = (_digits(n, self.max_len)[0] for n in numbers)
        target, target_lengths = _digits(numbers[0] + numbers[1], self.max_len)
        if self.name == "addition_reversed":
            target = _reversed(target, target_lengths)
        # "a+b": a's digits, then "+" at column a_len, then b's digits.
        col = np.arange(self.source_len)
        a_col, b_col = a_len[:, None], col - a_len[:, None] - 1
        from_a = np.pad(a, ((0, 0), (0, 1)))
        from_b = np.take_along_axis(b, np.clip(b_col, 0, self.max_len - 1), axis=1)
        source = np.where(col < a_col, from_a, np.where(col == a_col, ord("+"), from_b))
        return source, total + 1, target, target_lengths

    def _pack(self, source, source_lengths, target, target_lengths) -> dict[str, np.ndarray]:
        """Pad the raw [B, ≤S] source and [B, ≤T-1] answer bytes into the model's arrays."""
        src_col = np.arange(self.source_len)
        attention_mask = src_col < source_lengths[:, None]
        col = np.arange(self.target_len)
        answer = np.pad(target, ((0, 0), (0, self.target_len - target.shape[1])))
        shifted = np.pad(target, ((0, 0), (1, self.target_len - 1 - target.shape[1])))
        lengths = target_lengths[:, None]
        return {
            "input_ids": np.where(attention_mask, source, self.pad_id).astype(np.int32),
            "attention_mask": attention_mask,
            "decoder_input_ids": np.where(col == 0, self.bos_id, np.where(
                col <= lengths, shifted, self.pad_id)).astype(np.int32),
            "labels": np.where(col < lengths, answer, np.where(
                col == lengths, self.eos_id, self.pad_id)).astype(np.int32),
            "label_mask": col <= lengths,
        }
