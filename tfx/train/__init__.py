"""Training: data, objectives, optimiser, steps, checkpoints, metrics and the loop.

>>> from tfx.train import get_experiment, train
>>> result = train(get_experiment("gpt_char"), "runs/gpt_char")
"""

from tfx.train.config import DataConfig, Experiment, MeshConfig, OptimConfig, TrainConfig
from tfx.train.experiments import EXPERIMENTS, get_experiment
from tfx.train.loop import Trainer, TrainResult, train

__all__ = ["EXPERIMENTS", "DataConfig", "Experiment", "MeshConfig", "OptimConfig", "TrainConfig",
           "TrainResult", "Trainer", "get_experiment", "train"]
