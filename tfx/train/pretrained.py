"""Starting weights from another run (`train.init_from`): the base of a fine-tuning run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
from flax import nnx

from tfx.models.config import TransformerConfig
from tfx.models.presets import create
from tfx.train.checkpoint import Checkpoints, config_diff
from tfx.train.config import experiment_from_dict, run_identity, stored_identity
from tfx.train.optim import make_optimizer
from tfx.train.step import init_train_state

__all__ = ["pretrained_params"]


def pretrained_params(workdir: str | Path, model: TransformerConfig) -> nnx.State:
    """The nnx.Param state of the newest checkpoint of the run in `workdir`, a run that trained
    every weight of a model with config `model`.

    Raises ValueError naming `train.init_from` when the folder holds no run or no checkpoint,
    when its model config differs from `model` (listing the fields), or when the run itself
    trained only PEFT parameters.
    """
    path = Path(workdir) / "checkpoints" / "config.json"
    if not path.is_file():
        raise ValueError(f"train.init_from: {str(workdir)!r} holds no trained run (missing "
                         f"{path})")
    base = experiment_from_dict(json.loads(path.read_text()))
    if base.model != model:
        diffs = config_diff(dataclasses.asdict(base.model), dataclasses.asdict(model), "model")
        raise ValueError(f"train.init_from: {workdir} trained another model; differing fields "
                         "(base vs this run): " + "; ".join(f"{k}: {o!r} vs {n!r}"
                                                            for k, o, n in diffs))
    if base.peft.method != "full":
        raise ValueError(f"train.init_from: {workdir} trained only {base.peft.method} "
                         "parameters; start from a run that trained every weight")

    def abstract_state():
        trained = create(base.model, rngs=nnx.Rngs(0))
        optimizer = make_optimizer(base.optim, base.train.steps)
        return init_train_state(trained, optimizer, seed=0)[2].to_dict()

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            jax.eval_shape(abstract_state))
    with Checkpoints(path.parent, config=run_identity(base), read_only=True,
                     stored_form=stored_identity) as checkpoints:
        restored = checkpoints.restore(template, strict=True)  # never silently an older step
    if restored is None:
        raise ValueError(f"train.init_from: {workdir} holds no checkpoint yet")
    return restored[1]["params"]
