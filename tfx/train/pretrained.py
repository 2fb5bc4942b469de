"""Starting weights (`train.init_from`): the base of a fine-tuning run, either another tfx run or
a Hugging Face folder (what transformers' `save_pretrained` writes, with its tokenizer).

A Hugging Face base fixes what the model is: `adopt_base` takes the model config from the
folder's config.json (the run keeps only how it computes: `model.compute` and
`model.attention.implementation`) and the tokenizer from the folder, so vocabulary size and
special token ids are never set by hand. `from_pretrained` builds such an experiment in one call.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tfx.train.config import Experiment, experiment_from_dict

__all__ = ["adopt_base", "from_pretrained", "is_hf_base", "pretrained_params"]


def is_hf_base(init_from: str | Path | None) -> bool:
    """Whether `init_from` names a Hugging Face folder (a config.json with "architectures"),
    not a tfx run (which keeps its config in checkpoints/config.json)."""
    if init_from is None or (Path(init_from) / "checkpoints" / "config.json").is_file():
        return False
    from tfx.hf import is_checkpoint_folder

    return is_checkpoint_folder(init_from)


def adopt_base(experiment: Experiment) -> Experiment:
    """`experiment` with what a Hugging Face `train.init_from` fixes taken from the folder: the
    model config (keeping the experiment's `model.compute` and attention implementation), the
    tokenizer (the folder, unless `data.tokenizer` names another than "byte"), and init_from as
    an absolute path (so the run resumes from any working directory). Any other experiment is
    returned as it is. Raises ValueError for a folder tfx cannot load (naming it)."""
    base = experiment.train.init_from
    if not is_hf_base(base):
        return experiment
    from tfx.hf import folder_config

    folder = str(Path(base).resolve())
    model = folder_config(folder).replace(
        compute=experiment.model.compute,
        attention={"implementation": experiment.model.attention.implementation})
    data = experiment.data
    tokenizer = folder if data.tokenizer == "byte" else data.tokenizer
    return dataclasses.replace(
        experiment, model=model, data=dataclasses.replace(data, tokenizer=tokenizer),
        train=dataclasses.replace(experiment.train, init_from=folder))


def from_pretrained(path: str | Path, experiment: str | Experiment = "sft", *,
                    data: str | None = None, peft=None, **sections) -> Experiment:
    """The experiment that fine-tunes the Hugging Face folder `path` (or trains on from a tfx
    run): `experiment` (a name of `tfx.train.EXPERIMENTS` or an Experiment) with
    train.init_from = path, then `adopt_base`.

    Args:
      data: data.source (a JSONL file for sft and dpo, text for causal_lm).
      peft: a fine-tuning config (`tfx.train.finetuning.LoraTuning(rank=8)`) or a method name
        ("lora"); None keeps the experiment's (full fine-tuning).
      sections: changes to the experiment's sections as dicts, e.g.
        `train={"steps": 100, "batch_size": 8}`, `optim={"learning_rate": 1e-4}`.
    """
    from tfx.train.experiments import get_experiment
    from tfx.train.finetuning import peft_config

    chosen = get_experiment(experiment) if isinstance(experiment, str) else experiment
    changes = {name: dataclasses.replace(getattr(chosen, name), **fields)
               for name, fields in sections.items()}
    train = changes.get("train", chosen.train)
    changes["train"] = dataclasses.replace(train, init_from=str(path))
    if data is not None:
        changes["data"] = dataclasses.replace(changes.get("data", chosen.data), source=data)
    if peft is not None:
        changes["peft"] = peft_config(peft) if isinstance(peft, str) else peft
    return adopt_base(dataclasses.replace(chosen, **changes))


def pretrained_params(init_from: str | Path, model):
    """The nnx.Param state of the base `init_from` for a model of config `model`: a Hugging
    Face folder's weights, or those of the newest checkpoint of a tfx run that trained every
    weight.

    Raises ValueError naming `train.init_from` when the folder holds no run or no checkpoint,
    when its model differs from `model` (listing the fields), or when the run itself trained
    only PEFT parameters.
    """
    if is_hf_base(init_from):
        return _hf_params(Path(init_from), model)
    return _run_params(Path(init_from), model)


def _refuse_other_model(base, model, workdir) -> None:
    from tfx.train.checkpoint import config_diff

    if base != model:
        diffs = config_diff(dataclasses.asdict(base), dataclasses.asdict(model), "model")
        raise ValueError(f"train.init_from: {workdir} trained another model; differing fields "
                         "(base vs this run): " + "; ".join(f"{k}: {o!r} vs {n!r}"
                                                            for k, o, n in diffs))


def _hf_params(folder: Path, model):
    from flax import nnx

    from tfx import hf

    # The folder's model with this run's compute settings: the adopted config, unless the run
    # was given another model by hand.
    _refuse_other_model(hf.folder_config(folder).replace(
        compute=model.compute, attention={"implementation": model.attention.implementation}),
        model, folder)
    loaded = hf.load(folder, compute=dataclasses.asdict(model.compute),
                     attention={"implementation": model.attention.implementation})
    return nnx.state(loaded, nnx.Param)


def _run_params(workdir: Path, model):
    import jax
    from flax import nnx

    from tfx.models.presets import create
    from tfx.train.checkpoint import Checkpoints
    from tfx.train.config import run_identity, stored_identity
    from tfx.train.step import initial_state, restore_template

    path = workdir / "checkpoints" / "config.json"
    if not path.is_file():
        raise ValueError(f"train.init_from: {str(workdir)!r} holds no trained run (missing "
                         f"{path}) and is no Hugging Face folder (config.json with "
                         "\"architectures\" and *.safetensors)")
    base = experiment_from_dict(json.loads(path.read_text()))
    _refuse_other_model(base.model, model, workdir)
    if base.peft.method != "full":
        raise ValueError(f"train.init_from: {workdir} trained only {base.peft.method} "
                         "parameters; start from a run that trained every weight")

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    template = restore_template(
        lambda: initial_state(base, create(base.model, rngs=nnx.Rngs(0))), device)
    with Checkpoints(path.parent, config=run_identity(base), read_only=True,
                     stored_form=stored_identity) as checkpoints:
        restored = checkpoints.restore(template, strict=True)  # never silently an older step
    if restored is None:
        raise ValueError(f"train.init_from: {workdir} holds no checkpoint yet")
    return restored[1]["params"]
