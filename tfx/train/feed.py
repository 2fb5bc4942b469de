"""The batches of an experiment, one feed per kind of objective (tfx.train.objectives picks it):
training batch k is a function of (seed, k), and the validation batches are a fixed list; both
are dicts of numpy arrays with rows [batch_size, ...]. Each feed also names its tokenizer,
checked against the model config (vocab size, special token ids)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tfx.train.data import Tokenizer, load_corpus, load_tokenizer, mlm_batch
from tfx.train.tasks import SyntheticTask
from tfx.train.tokens import MLM_SPECIALS

if TYPE_CHECKING:
    from tfx.train.config import Experiment

__all__ = ["MaskedFeed", "TaskFeed", "TextFeed"]

# Validation batches drawn at random (masked LM, synthetic tasks) draw from seeds far from any
# training seed.
_VALIDATION_SEED_OFFSET = 1_000_003


class TextFeed:
    """Causal LM: {"tokens": int32 [B, seq_len + 1]}, windows of the corpus; validation windows
    are consecutive. Reading the corpus happens here, so a bad data path fails early."""

    def __init__(self, experiment: Experiment):
        self.experiment = experiment
        self.tokenizer = self.tokenizer_of(experiment)
        self.train_stream, self.val_stream = load_corpus(
            experiment.data.source, self.tokenizer, val_fraction=experiment.data.val_fraction)

    @classmethod
    def tokenizer_of(cls, experiment: Experiment) -> Tokenizer:
        """data.tokenizer, checked against the model config."""
        return _checked(load_tokenizer(experiment.data.tokenizer), experiment, {})

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens the model reads per training batch (for tokens/s)."""
        return self.experiment.train.batch_size * self.experiment.train.seq_len

    # train(step, rows=) builds only the asked rows (each process of a multi-process run its
    # own): from token shards, only their windows are read.
    reads_rows = True

    def train(self, step: int, rows: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
        """Training batch number `step` (the same on every run with this seed); with
        `rows=(start, stop)`, only those rows of it."""
        return self._batch(self.train_stream, step, self.experiment.train.seed, rows)

    def validation(self) -> list[dict[str, np.ndarray]]:
        """The fixed validation batches (train.eval_batches of them)."""
        t = self.experiment.train
        return [{"tokens": rows} for rows in
                self.val_stream.eval_batches(t.eval_batches, t.batch_size, t.seq_len)]

    def _batch(self, stream, step: int, seed: int, rows=None) -> dict[str, np.ndarray]:
        t = self.experiment.train
        return {"tokens": stream.batch(step, t.batch_size, t.seq_len, seed=seed, rows=rows)}


class MaskedFeed(TextFeed):
    """Masked LM: {"input_ids", "attention_mask" [B, seq_len]}, [CLS] text [SEP] rows padded
    with [PAD] (the masking itself is the loss's, drawn from the step's key)."""

    @classmethod
    def tokenizer_of(cls, experiment: Experiment) -> Tokenizer:
        """data.tokenizer with MLM_SPECIALS, whose ids the model config must name."""
        tokenizer = load_tokenizer(experiment.data.tokenizer, specials=MLM_SPECIALS)
        specials = experiment.model.special_tokens
        return _checked(tokenizer, experiment, {
            f"special_tokens.{n}_id": (getattr(specials, f"{n}_id"),
                                       tokenizer.token_id(f"[{n.upper()}]"))
            for n in ("pad", "cls", "sep", "mask")})

    def validation(self) -> list[dict[str, np.ndarray]]:
        t = self.experiment.train
        return [self._batch(self.val_stream, i, t.seed + _VALIDATION_SEED_OFFSET)
                for i in range(t.eval_batches)]

    def _batch(self, stream, step: int, seed: int, rows=None) -> dict[str, np.ndarray]:
        t = self.experiment.train
        ids = {n: self.tokenizer.token_id(f"[{n.upper()}]") for n in ("cls", "sep", "pad")}
        batch = mlm_batch(stream, step, t.batch_size, t.seq_len, seed=seed,
                          cls_id=ids["cls"], sep_id=ids["sep"], pad_id=ids["pad"])
        return batch if rows is None else {k: v[rows[0]:rows[1]] for k, v in batch.items()}


class TaskFeed:
    """Sequence-to-sequence on a synthetic task (data.task): {"input_ids", "attention_mask"
    [B, S], "decoder_input_ids", "labels", "label_mask" [B, T]}."""

    def __init__(self, experiment: Experiment):
        self.experiment = experiment
        self.tokenizer = self.tokenizer_of(experiment)
        data = experiment.data
        self.task = SyntheticTask(data.task, data.min_len, data.max_len)
        if max(self.task.source_len, self.task.target_len) > experiment.model.max_len and \
                experiment.model.position == "learned":
            raise ValueError(f"data.max_len ({data.max_len}) makes sequences longer than "
                             f"model.max_len ({experiment.model.max_len})")

    @classmethod
    def tokenizer_of(cls, experiment: Experiment) -> Tokenizer:
        """The task's own tokenizer, whose [BOS] the model's decoder must start from."""
        data = experiment.data
        tokenizer = SyntheticTask(data.task, data.min_len, data.max_len).tokenizer
        return _checked(tokenizer, experiment, {"decoder_start_token_id": (
            experiment.model.decoder_start_token_id, tokenizer.token_id("[BOS]"))})

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens the model reads per training batch (for tokens/s)."""
        t = self.experiment.train
        return t.batch_size * (self.task.source_len + self.task.target_len)

    def train(self, step: int) -> dict[str, np.ndarray]:
        """Training batch number `step` (the same on every run with this seed)."""
        t = self.experiment.train
        return self.task.batch(step, t.batch_size, seed=t.seed)

    def validation(self) -> list[dict[str, np.ndarray]]:
        """The fixed validation batches (train.eval_batches of them)."""
        t = self.experiment.train
        return [self.task.batch(i, t.batch_size, seed=t.seed + _VALIDATION_SEED_OFFSET)
                for i in range(t.eval_batches)]


def _checked(tokenizer: Tokenizer, experiment: Experiment,
             ids: dict[str, tuple[int, int]]) -> Tokenizer:
    """`tokenizer`, once the model config fits it: a vocabulary at least as large, and each
    model field in `ids` ({field: (the config's id, the tokenizer's)}) equal to the
    tokenizer's."""
    model = experiment.model
    if model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size ({model.vocab_size}) is smaller than the "
                         f"tokenizer's vocabulary ({tokenizer.vocab_size})")
    for field, (found, token_id) in ids.items():
        if found != token_id:
            raise ValueError(f"model.{field} must be {token_id} (the tokenizer's id), "
                             f"got {found}")
    return tokenizer
