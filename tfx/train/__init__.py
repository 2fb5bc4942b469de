"""Training: data, objectives, optimiser, steps, checkpoints, metrics and the loop.

>>> from tfx.train import get_experiment, train
>>> result = train(get_experiment("gpt_char"), "runs/gpt_char")

Names load on first use: the configs and experiments import without jax (the command line
reads them), the loop with it.
"""

from typing import TYPE_CHECKING

from tfx._lazy import lazy_exports

if TYPE_CHECKING:
    from tfx.train.checkpoint import CorruptCheckpointError
    from tfx.train.config import DataConfig, Experiment, MeshConfig, OptimConfig, TrainConfig
    from tfx.train.experiments import EXPERIMENTS, get_experiment
    from tfx.train.lock import WorkdirBusyError
    from tfx.train.loop import DivergenceError, Trainer, TrainResult, train
    from tfx.train.pretrained import from_pretrained
    from tfx.train.run import Run, load_run

__all__ = ["EXPERIMENTS", "CorruptCheckpointError", "DataConfig", "DivergenceError", "Experiment",
           "MeshConfig", "OptimConfig", "Run", "TrainConfig", "TrainResult", "Trainer",
           "WorkdirBusyError", "from_pretrained", "get_experiment", "load_run", "train"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "CorruptCheckpointError": "tfx.train.checkpoint:CorruptCheckpointError",
    **{name: f"tfx.train.config:{name}" for name in
       ("DataConfig", "Experiment", "MeshConfig", "OptimConfig", "TrainConfig")},
    "EXPERIMENTS": "tfx.train.experiments:EXPERIMENTS",
    "get_experiment": "tfx.train.experiments:get_experiment",
    "WorkdirBusyError": "tfx.train.lock:WorkdirBusyError",
    **{name: f"tfx.train.loop:{name}" for name in
       ("DivergenceError", "Trainer", "TrainResult", "train")},
    "from_pretrained": "tfx.train.pretrained:from_pretrained",
    "Run": "tfx.train.run:Run", "load_run": "tfx.train.run:load_run"})
