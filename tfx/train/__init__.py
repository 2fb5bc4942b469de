"""Training: data, objectives, optimiser, steps, checkpoints, metrics and the loop.

>>> from tfx.train import get_experiment, train
>>> result = train(get_experiment("gpt_char"), "runs/gpt_char")
"""

from tfx.train.checkpoint import CorruptCheckpointError
from tfx.train.config import DataConfig, Experiment, MeshConfig, OptimConfig, TrainConfig
from tfx.train.experiments import EXPERIMENTS, get_experiment
from tfx.train.lock import WorkdirBusyError
from tfx.train.loop import DivergenceError, Trainer, TrainResult, train

__all__ = ["EXPERIMENTS", "CorruptCheckpointError", "DataConfig", "DivergenceError", "Experiment",
           "MeshConfig", "OptimConfig", "TrainConfig", "TrainResult", "Trainer",
           "WorkdirBusyError", "get_experiment", "train"]
