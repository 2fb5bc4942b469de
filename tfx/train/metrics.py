"""Where a run's numbers go: DIR/metrics.jsonl (one JSON object per logged step), TensorBoard
event files (DIR/tensorboard) and, at the end, a loss-curve PNG (DIR/loss.png)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

__all__ = ["MetricsWriter", "plot_losses", "read_metrics"]


class MetricsWriter:
    """Appends {"step", "split", ...metrics} records; resuming a run keeps the earlier lines
    up to the step it resumes from (later ones belong to work that is being redone).
    enabled=False (processes other than the first of a multi-process run) writes nothing."""

    def __init__(self, workdir: str | Path, *, resume_step: int = 0, tensorboard: bool = True,
                 enabled: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _naming(self.path):
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("a")
        self._tensorboard = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tensorboard = SummaryWriter(str(Path(workdir) / "tensorboard"),
                                              purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, metrics: dict, *, split: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "split": split,
                  **{k: float(v) for k, v in metrics.items()}}
        with _naming(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            for name, value in metrics.items():
                self._tensorboard.add_scalar(f"{split}/{name}", float(value), int(step))

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if not self.enabled:
            return
        try:
            with _naming(self.path):
                self._file.close()
        finally:
            if self._tensorboard is not None:
                self._tensorboard.close()


@contextlib.contextmanager
def _naming(path: Path):
    """Re-raise an OSError that names no file (a full disk's ENOSPC on write) as one of the
    same kind naming `path`."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        raise type(error)(error.errno, error.strerror or str(error), str(path)) from error


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl ([] when there is none)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(records: list[dict], path: str | Path, *, title: str = "") -> Path:
    """Train and validation loss against step, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for split, style in (("train", "-"), ("val", "o-")):
        points = [(r["step"], r["loss"]) for r in records
                  if r.get("split") == split and math.isfinite(r.get("loss", math.nan))]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=split)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    if ax.get_lines():  # a run stopped before its first log has no curve to name
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
