"""Working with the PEFT parameters of a model: counting them, training only them with optax,
and saving / loading them alone (safetensors)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import numpy as np
import optax
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from tfx.nn.paths import path_name
from tfx.peft.adapters import Adapters
from tfx.peft.core import PeftParam
from tfx.peft.lora import LoRA
from tfx.peft.prefix import Prefix
from tfx.peft.prompt import SoftPrompt

__all__ = ["count", "load", "only_peft", "save"]


def count(model: nnx.Module) -> tuple[int, int]:
    """(trainable PEFT parameters, all parameters) of `model`."""
    peft = sum(x.size for x in jax.tree.leaves(nnx.state(model, PeftParam)))
    return peft, sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def only_peft(optimizer: optax.GradientTransformation,
              params: nnx.State) -> optax.GradientTransformation:
    """`optimizer` on the PEFT parameters of `params` (a model's nnx.Param state); the other
    parameters get zero updates and no optimiser state (`optax.multi_transform` with
    `optax.set_to_zero`), for training loops that keep the whole parameter tree together.
    (`tfx.train` instead splits the tree and never hands the frozen weights to the optimiser.)"""
    labels = jax.tree.map(lambda v: "peft" if isinstance(v, PeftParam) else "frozen", params,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    if "peft" not in jax.tree.leaves(labels):
        raise ValueError("params hold no PeftParam: attach a tfx.peft method to the model first")
    return optax.multi_transform({"peft": optimizer, "frozen": optax.set_to_zero()}, labels)


def save(model: nnx.Module, path: str | os.PathLike, *, method=None) -> None:
    """Write the model's PEFT parameters alone to a safetensors file ("a/b/c" names), with
    `method` (the tfx.peft settings object that added them) in its metadata so that `load`
    can rebuild them. Written to a temporary file first: a failed save leaves `path` as it was.
    """
    path = pathlib.Path(path)
    tensors = {path_name(k): np.asarray(v[...])
               for k, v in nnx.to_flat_state(nnx.state(model, PeftParam))}
    if not tensors:
        raise ValueError("the model has no PEFT parameters to save")
    metadata = {"format": "tfx.peft"}
    if method is not None:
        metadata["method"] = json.dumps({"type": type(method).__name__,
                                         "settings": dataclasses.asdict(method)})
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, partial, metadata=metadata)
    os.replace(partial, path)


def load(model: nnx.Module, path: str | os.PathLike, *, rngs: nnx.Rngs | None = None):
    """Load PEFT parameters saved by `save` into `model`, in place; returns the model.

    A model without PEFT parameters first gets the method stored in the file attached (needs
    its settings in the file). Raises ValueError when the file is missing or unreadable, or
    when its names or shapes differ from the model's PEFT parameters.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"path: no PEFT parameter file at {str(path)!r}")
    try:
        tensors = load_file(path)
        with safe_open(path, "numpy") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"path: {str(path)!r} is not a readable safetensors file ({e})") from e
    if not jax.tree.leaves(nnx.state(model, PeftParam)):
        if "method" not in metadata:
            raise ValueError(f"{path} does not say which PEFT method made it; attach the method "
                             "to the model before loading")
        _method_from(metadata["method"]).attach(model, rngs=rngs or nnx.Rngs(0))
    flat = nnx.to_flat_state(nnx.state(model, PeftParam))
    want = {path_name(k): v for k, v in flat}
    tensors = _moved_prompt(tensors, want)
    if want.keys() != tensors.keys():
        raise ValueError(f"{path} holds PEFT parameters {sorted(tensors)}, the model has "
                         f"{sorted(want)}")
    for name, variable in want.items():
        if tensors[name].shape != variable.shape:
            raise ValueError(f"{path}: {name} has shape {tensors[name].shape}, the model's "
                             f"{variable.shape}")
        variable[...] = tensors[name].astype(variable.dtype)
    return model


def _moved_prompt(tensors: dict, want: dict) -> dict:
    """Files saved before the soft prompt moved from the model into its embeddings name it
    "prompt/vectors": give it the model's new name ("embeddings/prompt/vectors", or
    "encoder_embeddings/..." for an encoder–decoder)."""
    new = [name for name in want if name.endswith("embeddings/prompt/vectors")]
    if "prompt/vectors" not in tensors or len(new) != 1:
        return tensors
    return {new[0] if name == "prompt/vectors" else name: t for name, t in tensors.items()}


# The methods a saved file can name, by class name (as `save` writes it).
METHODS = {cls.__name__: cls for cls in (LoRA, SoftPrompt, Prefix, Adapters)}


def _method_from(stored: str):
    data = json.loads(stored)
    cls = METHODS.get(data["type"])
    if cls is None:
        raise ValueError(f"unknown PEFT method {data['type']!r} in the file; known: "
                         f"{sorted(METHODS)}")
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in data["settings"].items()}
    return cls(**settings)
