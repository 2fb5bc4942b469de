"""Tiny experiments for the training tests: a few-kilobyte corpus and small models, so a run
of a few steps takes seconds; and damage done to a saved checkpoint."""

from __future__ import annotations

import dataclasses
import pathlib
from pathlib import Path

import numpy as np

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
    model = e.model.replace(d_model=32, num_heads=2, attention={"num_kv_heads": None}, d_ff=64,
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


def damage_payload(step_dir: pathlib.Path, array: np.ndarray, how: str) -> None:
    """Damage `array`'s bytes wherever they lie in the step's data files (orbax may keep them
    in more than one: its per-process OCDBT database and the merged one): flip one bit, or
    write 64 random bytes over them (what a bad disk or a partial overwrite does)."""
    needle = np.ascontiguousarray(array).tobytes()[:64]
    damaged = []
    for path in (p for p in step_dir.rglob("*") if p.is_file()):
        data = bytearray(path.read_bytes())
        at = data.find(needle)
        if at >= 0:
            if how == "flip_bit":
                data[at + 37] ^= 0x10
            else:
                data[at:at + 64] = np.random.default_rng(1).bytes(64)
            path.write_bytes(bytes(data))
            damaged.append(path)
    assert damaged, f"the array's bytes are in no file under {step_dir}"
