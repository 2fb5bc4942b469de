"""The batches of an experiment: its tokenizer, then training batch k = a function of
(seed, k) and a fixed list of validation batches, as dicts of numpy arrays."""

from __future__ import annotations

import numpy as np

from tfx.train.config import Experiment
from tfx.train.data import Tokenizer, load_corpus, load_tokenizer, mlm_batch
from tfx.train.experiments import MLM_SPECIALS
from tfx.train.tasks import SyntheticTask

__all__ = ["Feed", "experiment_tokenizer"]

# Validation batches of synthetic tasks draw from seeds far from any training seed.
_VALIDATION_SEED_OFFSET = 1_000_003


def experiment_tokenizer(experiment: Experiment) -> Tokenizer:
    """The tokenizer an experiment's model reads, checked against the model config (vocab
    size, and for masked LM the special token ids)."""
    data, model = experiment.data, experiment.model
    if experiment.objective == "seq2seq":
        tokenizer = SyntheticTask(data.task, data.min_len, data.max_len).tokenizer
        expected = {"decoder_start_token_id": tokenizer.token_id("[BOS]")}
        found = {"decoder_start_token_id": model.decoder_start_token_id}
    elif experiment.objective == "mlm":
        tokenizer = load_tokenizer(data.tokenizer, specials=MLM_SPECIALS)
        names = ("pad", "cls", "sep", "mask")
        expected = {f"special_tokens.{n}_id": tokenizer.token_id(f"[{n.upper()}]") for n in names}
        found = {f"special_tokens.{n}_id": getattr(model.special_tokens, f"{n}_id")
                 for n in names}
    else:
        tokenizer = load_tokenizer(data.tokenizer)
        expected = found = {}
    if model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size ({model.vocab_size}) is smaller than the "
                         f"tokenizer's vocabulary ({tokenizer.vocab_size})")
    for field, token_id in expected.items():
        if found[field] != token_id:
            raise ValueError(f"model.{field} must be {token_id} (the tokenizer's id), "
                             f"got {found[field]}")
    return tokenizer


class Feed:
    """Batches for `experiment`, rows [batch_size, ...] as numpy arrays:
    causal_lm {"tokens" [B, seq_len + 1]}, mlm {"input_ids", "attention_mask" [B, seq_len]},
    seq2seq {"input_ids", "attention_mask" [B, S], "decoder_input_ids", "labels",
    "label_mask" [B, T]}. Reading the corpus happens here, so a bad data path fails early."""

    def __init__(self, experiment: Experiment):
        self.experiment = experiment
        self.tokenizer = experiment_tokenizer(experiment)
        data = experiment.data
        if experiment.objective == "seq2seq":
            self.task = SyntheticTask(data.task, data.min_len, data.max_len)
            if max(self.task.source_len, self.task.target_len) > experiment.model.max_len and \
                    experiment.model.position == "learned":
                raise ValueError(f"data.max_len ({data.max_len}) makes sequences longer than "
                                 f"model.max_len ({experiment.model.max_len})")
        else:
            self.train_stream, self.val_stream = load_corpus(
                data.source, self.tokenizer, val_fraction=data.val_fraction)

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens the model reads per training batch (for tokens/s)."""
        t = self.experiment.train
        if self.experiment.objective == "seq2seq":
            return t.batch_size * (self.task.source_len + self.task.target_len)
        return t.batch_size * t.seq_len

    def train(self, step: int) -> dict[str, np.ndarray]:
        """Training batch number `step` (the same on every run with this seed)."""
        return self._batch(step, self.experiment.train.seed, self.train_stream
                           if self.experiment.objective != "seq2seq" else None)

    def validation(self) -> list[dict[str, np.ndarray]]:
        """The fixed validation batches (train.eval_batches of them)."""
        t = self.experiment.train
        if self.experiment.objective == "causal_lm":
            return [{"tokens": rows} for rows in
                    self.val_stream.eval_batches(t.eval_batches, t.batch_size, t.seq_len)]
        stream = None if self.experiment.objective == "seq2seq" else self.val_stream
        return [self._batch(i, t.seed + _VALIDATION_SEED_OFFSET, stream)
                for i in range(t.eval_batches)]

    def _batch(self, step: int, seed: int, stream) -> dict[str, np.ndarray]:
        t = self.experiment.train
        if self.experiment.objective == "seq2seq":
            return self.task.batch(step, t.batch_size, seed=seed)
        if self.experiment.objective == "mlm":
            ids = {n: self.tokenizer.token_id(f"[{n.upper()}]") for n in ("cls", "sep", "pad")}
            return mlm_batch(stream, step, t.batch_size, t.seq_len, seed=seed,
                             cls_id=ids["cls"], sep_id=ids["sep"], pad_id=ids["pad"])
        return {"tokens": stream.batch(step, t.batch_size, t.seq_len, seed=seed)}


