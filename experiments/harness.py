"""What every script in experiments/ shares: the command line (--json, --workdir, --out,
--smoke), training runs measured the same way, and the results it publishes into
experiments/results/: NAME.md (the table), NAME.json and NAME.png, each stamped with the exact
command and git revision that produced them, so that nothing in a results file is typed in by
hand.

A script looks like:

    def main(argv=None):
        parser = harness.parser(__doc__)
        args = parser.parse_args(argv)
        with harness.workdir(args) as runs:
            results = {...: harness.train_measured(experiment, runs / "name")}
        harness.publish("name", results, table=..., plot=..., args=args, argv=argv)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tfx.train.config import Experiment, TrainConfig
from tfx.train.loop import Trainer, train
from tfx.train.metrics import read_metrics

__all__ = ["RESULTS", "checkpointed", "markdown_table", "measure_checkpoints", "parser", "plt",
           "publish", "smoke_train", "train_measured", "workdir"]

RESULTS = Path(__file__).parent / "results"


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the options every experiment has; the script adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--json", type=Path, help="also write the results (JSON) here")
    p.add_argument("--workdir", type=Path, help="where runs go (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for NAME.{md,json,png}")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model and a few steps: checks that the script runs")
    return p


@contextlib.contextmanager
def workdir(args: argparse.Namespace) -> Iterator[Path]:
    """args.workdir, or a temporary folder removed afterwards."""
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        yield args.workdir
        return
    with tempfile.TemporaryDirectory() as scratch:
        yield Path(scratch)


def smoke_train(train_config: TrainConfig, *, steps: int = 3, seq_len: int = 32) -> TrainConfig:
    """`train_config` cut down to a few steps of 4 short sequences, one eval batch."""
    return dataclasses.replace(train_config, steps=steps, batch_size=4, seq_len=seq_len,
                               log_every=1, eval_every=steps, eval_batches=1,
                               checkpoint_every=steps)


def checkpointed(experiment: Experiment, steps: int, *, points: int, smoke: bool,
                 smoke_model: dict) -> Experiment:
    """`experiment` for `steps` steps, checkpointed at `points` evenly spaced steps (all kept,
    for `measure_checkpoints`), evaluated by the loop at the end only. Warmup is capped at a
    fifth of the steps. Smoke: `smoke_train`'s short batches and `smoke_model`'s sizes."""
    every = max(1, steps // points)
    train = dataclasses.replace(experiment.train, steps=steps)
    if smoke:
        train = smoke_train(train, steps=steps)
    train = dataclasses.replace(
        train, checkpoint_every=every, keep_checkpoints=steps // every + 1, eval_every=steps)
    optim = dataclasses.replace(experiment.optim,
                                warmup_steps=min(experiment.optim.warmup_steps, steps // 5))
    model = experiment.model.replace(**smoke_model) if smoke else experiment.model
    return dataclasses.replace(experiment, model=model, train=train, optim=optim)


def measure_checkpoints(experiment: Experiment, workdir: Path,
                        measure: Callable[[Trainer], dict]) -> list[dict]:
    """[{"step": s, **measure(trainer)}] for the initialisation (s = 0) and every checkpoint
    of the finished run in `workdir`, oldest first."""
    trainer = Trainer(experiment, workdir)
    try:
        points = [{"step": 0, **measure(trainer)}]
        for step in trainer.checkpoints.all_steps():
            _, values = trainer.checkpoints.restore(trainer.state.to_dict(), step=step)
            trainer.state = dataclasses.replace(trainer.state, **values)
            points.append({"step": step, **measure(trainer)})
    finally:
        trainer.close()
    return points


def train_measured(experiment: Experiment, workdir: Path) -> dict:
    """Train `experiment` in `workdir` (a fresh folder: an existing run would resume) and
    measure it.

    Returns: val_loss and val_accuracy at the last step; tokens_per_s, the median of the logged
    training speeds except the first (which includes compilation), and step_seconds from it;
    curve, [(step, validation loss)]; train_curve, [(step, training loss)].
    """
    result = train(experiment, workdir, progress=False)
    records = read_metrics(workdir / "metrics.jsonl")
    train_records = [r for r in records if r.get("split") == "train"]
    speeds = [r["tokens_per_s"] for r in train_records if "tokens_per_s" in r][1:]
    tokens_per_s = statistics.median(speeds) if speeds else None
    tokens_per_step = experiment.train.batch_size * experiment.train.seq_len
    return {"val_loss": result.validation["loss"],
            "val_accuracy": result.validation.get("accuracy"),
            "tokens_per_s": tokens_per_s,
            "step_seconds": None if tokens_per_s is None else tokens_per_step / tokens_per_s,
            "curve": [(r["step"], r["loss"]) for r in records if r.get("split") == "val"],
            "train_curve": [(r["step"], r["loss"]) for r in train_records]}


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A markdown table; cells are written with str() (format numbers before)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def revision() -> str:
    """`git describe --always --dirty` of this checkout ("unknown" outside git)."""
    described = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                               text=True, cwd=Path(__file__).parent)
    return described.stdout.strip() or "unknown"


def command(script: str, argv: list[str] | None) -> str:
    """The command line that ran `script` with `argv` (sys.argv when None)."""
    return f"python experiments/{script}.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)


def publish(name: str, results: dict, *, table: str, plot: Callable[[Path], None],
            args: argparse.Namespace, argv: list[str] | None) -> None:
    """Write args.out/NAME.md (the command and revision, then `table`), NAME.json (command,
    revision and `results`), NAME.png (`plot(path)`), and `results` alone to args.json."""
    stamp = {"command": command(name, argv), "revision": revision()}
    args.out.mkdir(parents=True, exist_ok=True)
    header = f"Command: `{stamp['command']}` at revision `{stamp['revision']}`.\n\n"
    (args.out / f"{name}.md").write_text(header + table.rstrip("\n") + "\n")
    (args.out / f"{name}.json").write_text(json.dumps({**stamp, "results": results}, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    plot(args.out / f"{name}.png")
    plt.close("all")
    print(header + table, flush=True)
