"""A trained run as Python objects: `load_run(workdir)` for `tfx.generate`, evaluation, notebooks.

>>> run = tfx.train.load_run("runs/gpt_char")
>>> ids = run.tokenizer.encode("def ")[None]
>>> text = run.tokenizer.decode(tfx.generate(run.model, ids, max_new_tokens=50)[0])

Not through `tfx.train.Trainer`: that one also reads the corpus, builds the optimiser state
and its sharding and wraps the train and eval steps, none of which a loaded model needs (and
the corpus may be gone). The model is built at step 0 the way the run built it (`initial_model`,
shared with the Trainer), then takes the checkpoint's parameters. The optimiser state is never
built, only traced for its shapes (`jax.eval_shape`): orbax's standard restore reads a step as
one tree, so its moments are read with the parameters, verified against their checksums, and
dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import jax
from flax import nnx

from tfx.models.presets import create
from tfx.peft import PeftParam
from tfx.train.checkpoint import Checkpoints, CorruptCheckpointError
from tfx.train.config import (
    Experiment,
    experiment_from_dict,
    non_empty_path,
    run_identity,
    stored_identity,
)
from tfx.train.data import Tokenizer
from tfx.train.objectives import get_objective
from tfx.train.pretrained import pretrained_params
from tfx.train.step import initial_state, restore_template

__all__ = ["Run", "initial_model", "load_run", "stored_experiment"]


class Run(NamedTuple):
    """A trained run: its model (eval mode, the checkpoint's parameters), the tokenizer it
    read (`encode(text) -> int32 [n]`, `decode(ids) -> str`), its experiment as stored (the
    loop-only settings such as `train.log_every`, and the mesh, are not part of a run: they
    read as their defaults) and the step the checkpoint holds."""

    model: nnx.Module
    tokenizer: Tokenizer
    experiment: Experiment
    step: int


def load_run(workdir: str | Path, *, step: int | None = None) -> Run:
    """The run that `tfx train --workdir WORKDIR` (or `tfx.train.train`) trained in `workdir`.

    Args:
      workdir: the run's folder (it holds checkpoints/config.json and checkpoints/<step>/).
      step: the checkpoint to load; None: the newest one.
    Returns:
      `Run(model, tokenizer, experiment, step)`, the model on this process's first device in
      eval mode
      (dropout off), its parameters in their training dtype (float32 master weights).
    Raises:
      ValueError: naming the workdir: no run there, no checkpoint yet, a `step` that is not
        saved, or a config this tfx cannot read.
      tfx.train.CorruptCheckpointError: (a ValueError) when the checkpoint asked for (by
        default the newest) is damaged: an older step is never loaded in its place without
        being asked for.
    """
    experiment = stored_experiment(workdir)
    tokenizer = get_objective(experiment.objective).tokenizer(experiment)
    # A full fine-tune's checkpoint holds every weight: its base run need not be read again.
    model, trainable = initial_model(experiment,
                                     base_weights=experiment.peft.method != "full")
    # This process's first device: in a multi-process run jax.devices()[0] belongs to
    # process 0, and every process loads the run for itself.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    template = restore_template(lambda: initial_state(experiment, model, trainable), device)
    directory = Path(workdir) / "checkpoints"
    with Checkpoints(directory, config=run_identity(experiment), read_only=True,
                     stored_form=stored_identity) as checkpoints:
        try:
            restored = checkpoints.restore(template, step, strict=True)
        except CorruptCheckpointError as error:
            damaged = checkpoints.latest_step() if step is None else step
            others = [s for s in checkpoints.all_steps() if s != damaged]
            if others:
                error.add_note(f"to load another saved step: load_run({str(workdir)!r}, "
                               f"step=N) with N in {others}")
            raise
    if restored is None:
        raise ValueError(f"{workdir} holds no checkpoint yet: its run stopped before its first "
                         "save (train.checkpoint_every); run the same `tfx train --workdir "
                         f"{workdir}` command again to resume it")
    step, values = restored
    nnx.update(model, values["params"])
    model.eval()
    return Run(model=model, tokenizer=tokenizer, experiment=experiment, step=step)


def stored_experiment(workdir: str | Path) -> Experiment:
    """The experiment of the run in `workdir`, read from its checkpoints/config.json (any
    config version: migrated); ValueError naming the workdir when there is none."""
    non_empty_path("workdir", workdir)
    path = Path(workdir) / "checkpoints" / "config.json"
    if not path.is_file():
        raise ValueError(f"no trained run in {workdir} (missing {path}); train one with "
                         f"`tfx train --workdir {workdir}`")
    try:
        return experiment_from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"{path} holds a config this tfx cannot read ({error})") from error


def initial_model(experiment: Experiment, *, base_weights: bool = True,
                  ) -> tuple[nnx.Module, nnx.filterlib.Filter]:
    """The run's model at step 0 and the filter of its trained parameters.

    The seed's initialisation, then (base_weights) the weights of `train.init_from`, then the
    method's change of the base (QLoRA quantizes it), then the parameters that a PEFT method
    adds (those are then the only trained ones: `PeftParam`).
    """
    t = experiment.train
    model = create(experiment.model, rngs=nnx.Rngs(t.seed))
    if t.init_from is not None and base_weights:
        nnx.update(model, pretrained_params(t.init_from, experiment.model))
    method = experiment.peft.settings()
    if method is None:
        return model, nnx.Param
    experiment.peft.prepare_base(model)  # e.g. QLoRA's quantized base
    method.attach(model, rngs=nnx.Rngs(t.seed + 1))  # fine-tune only what the method adds
    return model, PeftParam
