"""Tiny experiments for the training tests: a few-kilobyte corpus and small models, so a run
of a few steps takes seconds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tfx.train.config import DataConfig, TrainConfig
from tfx.train.experiments import get_experiment

CORPUS = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200))


def write_corpus(folder: Path) -> Path:
    path = folder / "corpus.txt"
    path.write_text(CORPUS)
    return path


def tiny(name: str, data: Path | None = None, **train):
    """Experiment `name` shrunk: one small layer, short sequences, a handful of steps."""
    e = get_experiment(name)
    model = e.model.replace(d_model=32, num_heads=2, num_kv_heads=None, d_ff=64,
                            num_layers=1)
    settings = dict(steps=6, batch_size=4, seq_len=32, log_every=2, eval_every=3,
                    eval_batches=2, checkpoint_every=3)
    settings.update(train)
    replaced = dict(model=model, train=TrainConfig(**settings))
    if data is not None and e.objective != "seq2seq":
        replaced["data"] = DataConfig(source=str(data))
    if e.objective == "seq2seq":
        replaced["data"] = dataclasses.replace(e.data, max_len=6)
    return dataclasses.replace(e, **replaced)
