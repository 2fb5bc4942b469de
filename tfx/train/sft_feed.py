"""The batches of supervised fine-tuning (objective sft): the examples of a JSONL file
(`tfx.train.instructions.read_sft`), each a token row whose loss mask marks the answer.

Unpacked, a row is one example, right-padded; with data.packing whole examples share rows as
segments (`tfx.train.packing`), and the loss masks are laid out with the same packing, so both
the document boundaries and the answer masks survive. Training batch k is drawn with
`np.random.default_rng([seed, k])`; validation batches are evenly spaced held-out examples.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tfx.train.data import Tokenizer, load_tokenizer
from tfx.train.packing import Packed, pack

if TYPE_CHECKING:
    from tfx.train.config import Experiment
    from tfx.train.instructions import Example

__all__ = ["ExampleFeed", "PackedSftFeed", "SftFeed", "split_examples"]


def split_examples(examples: Sequence, val_fraction: float) -> tuple[list, list]:
    """(train, val), both non-empty and in input order: the max(1, round(val_fraction · n))
    examples with the smallest crc32 of their token bytes are held out, so an example keeps
    its side whatever the file's order. ValueError for fewer than two examples."""
    n = len(examples)
    if n < 2:
        raise ValueError(f"data: {n} usable example(s); sft and dpo need at least 2 (one is "
                         "held out for validation)")
    num_val = min(max(1, round(val_fraction * n)), n - 1)
    keys = [zlib.crc32(b"".join(np.ascontiguousarray(a).tobytes() for a in _arrays(e)))
            for e in examples]
    held = set(sorted(range(n), key=lambda i: (keys[i], i))[:num_val])
    return ([e for i, e in enumerate(examples) if i not in held],
            [e for i, e in enumerate(examples) if i in held])


def _arrays(example) -> tuple[np.ndarray, ...]:
    """The token arrays of an SFT example or a preference pair (its dataclass fields)."""
    return tuple(v for v in vars(example).values() if isinstance(v, np.ndarray))


def chat_tokenizer(experiment: Experiment, objective: str):
    """data.tokenizer as a `tfx.train.chat.ChatTokenizer` (a transformers tokenizer folder),
    checked against the model config; ValueError saying how to give one otherwise."""
    from tfx.train.chat import ChatTokenizer
    from tfx.train.feed import _checked

    tokenizer = load_tokenizer(experiment.data.tokenizer)
    if not isinstance(tokenizer, ChatTokenizer):
        raise ValueError(f"objective {objective!r} needs a transformers tokenizer folder "
                         "(tokenizer.json + tokenizer_config.json) for its special tokens and "
                         f"chat template: start from a Hugging Face folder (--init-from "
                         f"FOLDER) or set data.tokenizer, got {experiment.data.tokenizer!r}")
    return _checked(tokenizer, experiment, {})


def data_source(experiment: Experiment, objective: str, lines: str) -> str:
    """data.source, which the JSONL objectives need (ValueError naming the line format)."""
    if experiment.data.source is None:
        raise ValueError(f"objective {objective!r} needs data.source (--data FILE): a JSONL "
                         f"file of {lines} lines")
    return experiment.data.source


def warn_skipped(skipped: int, source: str) -> None:
    if skipped:
        warnings.warn(f"data: skipped {skipped} bad line(s) of {source} (data.skip_bad_lines)",
                      UserWarning, stacklevel=3)


class ExampleFeed:
    """What the JSONL feeds share (sft examples, dpo pairs): examples held per split, a
    subclass's `_count(split)` and `_batch(split, picked)`. Training batch k draws
    train.batch_size of them with `default_rng([seed, k])`; the validation batches are evenly
    spaced held-out ones (no randomness)."""

    @property
    def pad_id(self) -> int:
        """The padding token: the tokenizer's pad id, else its EOS, else 0."""
        t = self.tokenizer
        return next((i for i in (t.pad_id, t.eos_id) if i is not None), 0)

    def train(self, step: int) -> dict[str, np.ndarray]:
        """Training batch number `step` (the same on every run with this seed)."""
        t = self.experiment.train
        picked = np.random.default_rng([t.seed, step]).integers(0, self._count("train"),
                                                                t.batch_size)
        return self._batch("train", picked)

    def validation(self) -> list[dict[str, np.ndarray]]:
        """train.eval_batches batches of evenly spaced held-out rows (no randomness)."""
        t = self.experiment.train
        picked = np.round(np.linspace(0, self._count("val") - 1, t.eval_batches * t.batch_size))
        return [self._batch("val", rows) for rows in
                picked.astype(int).reshape(t.eval_batches, t.batch_size)]


class SftFeed(ExampleFeed):
    """{"tokens" int32, "loss_mask" bool} [B, seq_len + 1]: one example per row, padded on the
    right with the tokenizer's pad id (its EOS, else 0) and a False mask
    (tfx.train.losses.supervised reads them)."""

    def __init__(self, experiment: Experiment):
        from tfx.train.instructions import read_sft

        self.experiment = experiment
        self.tokenizer = self.tokenizer_of(experiment)
        source = data_source(experiment, "sft", '{"prompt", "completion"} or {"messages"}')
        examples, skipped = read_sft(source, self.tokenizer,
                                     max_tokens=experiment.train.seq_len + 1,
                                     skip_bad=experiment.data.skip_bad_lines)
        warn_skipped(skipped, source)
        self.train_examples, self.val_examples = split_examples(
            examples, experiment.data.val_fraction)

    @classmethod
    def tokenizer_of(cls, experiment: Experiment) -> Tokenizer:
        """data.tokenizer, a transformers tokenizer folder, checked against the model."""
        return chat_tokenizer(experiment, "sft")

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens the model reads per training batch (for tokens/s)."""
        return self.experiment.train.batch_size * self.experiment.train.seq_len

    def _count(self, split: str) -> int:
        return len(self.train_examples if split == "train" else self.val_examples)

    def _batch(self, split: str, picked: np.ndarray) -> dict[str, np.ndarray]:
        examples = self.train_examples if split == "train" else self.val_examples
        width = self.experiment.train.seq_len + 1
        tokens = np.full((len(picked), width), self.pad_id, np.int32)
        loss_mask = np.zeros((len(picked), width), bool)
        for row, i in enumerate(picked):
            example: Example = examples[i]
            tokens[row, :len(example.ids)] = example.ids
            loss_mask[row, :len(example.ids)] = example.loss_mask
        return {"tokens": tokens, "loss_mask": loss_mask}


class PackedSftFeed(SftFeed):
    """SFT on packed examples: {"tokens", "loss_mask", "segment_ids", "positions"}
    [B, seq_len + 1] (tfx.train.packed_losses.packed_supervised). The masks are packed like
    the tokens: the packing depends only on the lengths, so both land in the same places."""

    def __init__(self, experiment: Experiment):
        super().__init__(experiment)
        self.rows = {split: self._pack(examples) for split, examples in
                     (("train", self.train_examples), ("val", self.val_examples))}

    def _pack(self, examples: list) -> tuple[Packed, np.ndarray]:
        width = self.experiment.train.seq_len + 1
        tokens = pack([e.ids for e in examples], width, pad_id=self.pad_id)
        masks = pack([e.loss_mask.astype(np.uint8) for e in examples], width)
        return tokens, masks.tokens.astype(bool)

    def _count(self, split: str) -> int:
        return len(self.rows[split][1])

    def _batch(self, split: str, picked: np.ndarray) -> dict[str, np.ndarray]:
        packed, masks = self.rows[split]
        return {"tokens": packed.tokens[picked].astype(np.int32), "loss_mask": masks[picked],
                "segment_ids": packed.segment_ids[picked].astype(np.int32),
                "positions": packed.positions[picked].astype(np.int32)}
