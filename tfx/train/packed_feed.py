"""The feeds of `data.packing`: whole documents packed into rows (tfx.train.packing), each
document a segment with its own positions, instead of windows cut across documents.

Documents are the files of the embedded corpus or of a data folder, the non-empty lines of a
single text file (`data.source` a file), or the examples of a synthetic task. Text is packed
once, here; training batch k picks rows with `np.random.default_rng([seed, k])`, and the
validation batches are evenly spaced rows. A synthetic task has no end, so its examples are
drawn and packed per batch, from the same (seed, k).

`PACKED_FEEDS` maps each feed to its packed form (tfx.train.objectives picks it).
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

import numpy as np

from tfx.train.data import Tokenizer, corpus_texts, split_texts
from tfx.train.feed import _VALIDATION_SEED_OFFSET, MaskedFeed, TaskFeed, TextFeed
from tfx.train.packing import Packed, lay_out, pack
from tfx.train.sft_feed import PackedSftFeed, SftFeed
from tfx.train.shards import is_shard_folder, load_shard_corpus

if TYPE_CHECKING:
    from tfx.train.config import Experiment

__all__ = ["PACKED_FEEDS", "PackedMaskedFeed", "PackedTaskFeed", "PackedTextFeed",
           "load_documents"]


def load_documents(data: str | None, tokenizer: Tokenizer, *, val_fraction: float = 0.05,
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, val) documents, int 1-D token arrays: the texts of `tfx.train.data.load_corpus`
    (split the same way), each file a document, or each non-empty line when `data` is a
    single file; or, when `data` is a token-shard folder, the documents it was tokenized from
    (split when tokenized: `tfx.train.shards`)."""
    if is_shard_folder(data):  # tokenized already: cut each split's stream at its starts
        splits = load_shard_corpus(data, tokenizer, val_fraction=val_fraction)
        gap = len(splits[0].manifest.separator)  # the "\n\n" ids that join two documents

        def spans(stream):
            tokens, starts = stream.windows([0], len(stream))[0], stream.document_starts
            ends = np.append(starts[1:] - gap, len(stream))
            return [tokens[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]

        return tuple(spans(stream) for stream in splits)
    texts = corpus_texts(data)
    by_line = data not in (None, "stdlib") and pathlib.Path(data).is_file()

    def documents(part):
        return [tokenizer.encode(piece) for _, text in part
                for piece in (text.splitlines() if by_line else [text]) if piece.strip()]

    return tuple(documents(part) for part in split_texts(texts, val_fraction))


def _rows(packed: Packed, picked: np.ndarray, names: tuple[str, str, str]) -> dict:
    """Rows `picked` of a packing as int32 arrays named (tokens, segment ids, positions)."""
    arrays = (packed.tokens, packed.segment_ids, packed.positions)
    return {n: a[picked].astype(np.int32) for n, a in zip(names, arrays, strict=True)}


class PackedTextFeed(TextFeed):
    """Causal LM on packed documents: {"tokens", "segment_ids", "positions"} int32
    [B, seq_len + 1] (tfx.train.packed_losses.packed_causal_lm reads them)."""

    names = ("tokens", "segment_ids", "positions")
    reads_rows = False  # rows are drawn from the packing, in memory

    def __init__(self, experiment: Experiment):
        self.experiment = experiment
        self.tokenizer = self.tokenizer_of(experiment)
        train, val = load_documents(experiment.data.source, self.tokenizer,
                                    val_fraction=experiment.data.val_fraction)
        self.train_rows, self.val_rows = (self._pack(docs) for docs in (train, val))

    def _pack(self, documents: list[np.ndarray]) -> Packed:
        return pack(documents, self.experiment.train.seq_len + 1)

    def train(self, step: int) -> dict[str, np.ndarray]:
        """Training batch number `step`: rows drawn from `default_rng([seed, step])`."""
        t = self.experiment.train
        rng = np.random.default_rng([t.seed, step])
        return _rows(self.train_rows, rng.integers(0, len(self.train_rows.tokens),
                                                   t.batch_size), self.names)

    def validation(self) -> list[dict[str, np.ndarray]]:
        """train.eval_batches batches of evenly spaced validation rows (no randomness)."""
        t = self.experiment.train
        count = t.eval_batches * t.batch_size
        picked = np.round(np.linspace(0, len(self.val_rows.tokens) - 1, count)).astype(int)
        return [_rows(self.val_rows, rows, self.names)
                for rows in picked.reshape(t.eval_batches, t.batch_size)]


class PackedMaskedFeed(MaskedFeed, PackedTextFeed):
    """Masked LM on packed `[CLS] text [SEP]` pieces (a document longer than a row is cut into
    pieces of seq_len - 2 tokens, each wrapped): {"input_ids", "segment_ids", "positions"}
    int32 [B, seq_len]."""

    names = ("input_ids", "segment_ids", "positions")
    validation = PackedTextFeed.validation  # not MaskedFeed's

    def _pack(self, documents: list[np.ndarray]) -> Packed:
        seq_len = self.experiment.train.seq_len
        cls, sep, pad = (self.tokenizer.token_id(n) for n in ("[CLS]", "[SEP]", "[PAD]"))
        width = seq_len - 2
        pieces = [np.concatenate([[cls], doc[i:i + width], [sep]]).astype(np.int32)
                  for doc in documents for i in range(0, len(doc), width)]
        return pack(pieces, seq_len, pad_id=pad)


class PackedTaskFeed(TaskFeed):
    """Sequence-to-sequence on packed examples of a synthetic task, train.seq_len positions
    on each side: {"input_ids", "segment_ids", "positions"} int32 [B, seq_len] and
    {"decoder_input_ids", "labels", "decoder_segment_ids", "decoder_positions"} int32
    [B, seq_len]; example k of a row is source segment k and target segment k.

    Batch k draws examples from (seed, k) and fills rows in order, each until the next example
    does not fit on its source or its target side (next fit: both sides must agree on the rows,
    so a one-sided best fit would not do; the examples are short, so little is lost).
    """

    def __init__(self, experiment: Experiment):
        super().__init__(experiment)
        longest = max(self.task.source_len, self.task.target_len)
        if experiment.train.seq_len < longest:
            raise ValueError(f"train.seq_len ({experiment.train.seq_len}) must hold the "
                             f"longest example of data.max_len={experiment.data.max_len} "
                             f"({longest} tokens) when data.packing is on")

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens the model reads per training batch (for tokens/s)."""
        t = self.experiment.train
        return t.batch_size * 2 * t.seq_len

    def train(self, step: int) -> dict[str, np.ndarray]:
        """Training batch number `step` (the same on every run with this seed)."""
        return self._batch(step, self.experiment.train.seed)

    def validation(self) -> list[dict[str, np.ndarray]]:
        """The fixed validation batches (train.eval_batches of them)."""
        t = self.experiment.train
        return [self._batch(i, t.seed + _VALIDATION_SEED_OFFSET)
                for i in range(t.eval_batches)]

    def _batch(self, step: int, seed: int) -> dict[str, np.ndarray]:
        t = self.experiment.train
        # A row holds at most seq_len // min_len examples (no source is shorter than min_len),
        # so this many always fill batch_size rows and open one more.
        count = t.batch_size * (t.seq_len // self.task.min_len + 1)
        examples = self.task.batch(step, count, seed=seed)
        sources = _unpadded(examples["input_ids"], examples["attention_mask"])
        mask = examples["label_mask"]
        inputs = _unpadded(examples["decoder_input_ids"], mask)
        labels = _unpadded(examples["labels"], mask)
        rows = _next_fit([len(s) for s in sources], [len(x) for x in inputs], t.seq_len)
        keep = rows < t.batch_size
        source = lay_out([s for s, k in zip(sources, keep, strict=True) if k], rows[keep],
                         t.seq_len, pad_id=self.task.pad_id)
        target = [lay_out([x for x, k in zip(side, keep, strict=True) if k], rows[keep],
                          t.seq_len, pad_id=self.task.pad_id) for side in (inputs, labels)]
        return {**_rows(source, slice(None), ("input_ids", "segment_ids", "positions")),
                **_rows(target[0], slice(None), ("decoder_input_ids", "decoder_segment_ids",
                                                 "decoder_positions")),
                "labels": target[1].tokens.astype(np.int32)}


def _unpadded(ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """Rows of ids [N, L] cut to their mask [N, L] (True on a prefix of each row)."""
    return np.split(ids[mask], np.cumsum(mask.sum(1))[:-1])


def _next_fit(source_lengths: list[int], target_lengths: list[int], row_len: int,
              ) -> np.ndarray:
    """The row of each example, int64 [N]: in order, each row takes examples until the next
    one's source or target does not fit in what is left of row_len."""
    rows = np.empty(len(source_lengths), np.int64)
    row, used_source, used_target = 0, 0, 0
    for i, (s, t) in enumerate(zip(source_lengths, target_lengths, strict=True)):
        if used_source + s > row_len or used_target + t > row_len:
            row, used_source, used_target = row + 1, 0, 0
        rows[i] = row
        used_source, used_target = used_source + s, used_target + t
    return rows


PACKED_FEEDS = {TextFeed: PackedTextFeed, MaskedFeed: PackedMaskedFeed, TaskFeed: PackedTaskFeed,
                SftFeed: PackedSftFeed}
