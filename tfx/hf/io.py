"""Files of a Hugging Face checkpoint folder, and moving arrays in and out of an NNX model.

Reads `config.json` and `*.safetensors` (one file or a sharded `model.safetensors.index.json`)
with numpy; refuses pickle checkpoints. Every failure names the file or tensor at fault.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["assign_params", "flat_params", "read_config", "read_json", "read_tensors",
           "stack_layers", "tensor", "unstack_layers", "write_folder"]

Path = tuple[str | int, ...]
_PICKLES = ("pytorch_model.bin", "model.bin", "pytorch_model.bin.index.json", "model.pt",
            "tf_model.h5", "flax_model.msgpack")


def read_config(folder: pathlib.Path) -> dict:
    """The parsed config.json of a checkpoint folder."""
    if not folder.is_dir():
        raise ValueError(f"checkpoint path {folder} is not a folder (expected what "
                         "transformers' save_pretrained writes: config.json + *.safetensors)")
    return read_json(folder / "config.json", dict, "a checkpoint folder needs its config.json")


def read_json(path: pathlib.Path, kind: type, missing: str) -> dict | list:
    """Parse a JSON file that must hold a `kind` (dict or list); `missing` says why it must
    exist when it does not."""
    if not path.is_file():
        raise ValueError(f"{path} is missing: {missing}")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path} must hold a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def read_tensors(folder: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors file(s), by name, as numpy arrays."""
    from safetensors import SafetensorError

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as error:
            raise ValueError(f"{index} is not a valid safetensors index: {error!r}") from None
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        pickles = [name for name in _PICKLES if (folder / name).exists()]
        if pickles:
            raise ValueError(
                f"{folder} holds only pickle weights ({', '.join(pickles)}); tfx reads "
                "safetensors only. Convert with transformers: "
                "AutoModel.from_pretrained(path).save_pretrained(path, safe_serialization=True)")
        raise ValueError(f"{folder} has no *.safetensors weights")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path} is listed in the index but missing")
        try:
            tensors.update(_load(path))
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f"{path} is not a readable safetensors file: {error}") from None
    return tensors


def tensor(tensors: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """`tensors[name]`, or a ValueError saying that the checkpoint lacks that tensor."""
    if name not in tensors:
        raise ValueError(f"tensor {name!r} is missing from the checkpoint")
    return tensors[name]


def _load(path: pathlib.Path) -> dict[str, np.ndarray]:
    # The flax reader handles bfloat16 (numpy's does not); arrays come back as numpy with
    # ml_dtypes' bfloat16 where the file has it.
    from safetensors.flax import load_file

    return {name: np.asarray(value) for name, value in load_file(str(path)).items()}


def flat_params(model: nnx.Module) -> dict[Path, np.ndarray]:
    """The model's parameters by state path, e.g. ('stack', 'layers', 0, 'mlp', 'up', 'kernel')."""
    state = nnx.state(model, nnx.Param)
    return {path: np.asarray(var[...]) for path, var in nnx.to_flat_state(state)}


def assign_params(model: nnx.Module, params: Mapping[Path, np.ndarray], *,
                  source: str, optional: tuple[Path, ...] = ()) -> None:
    """Set every parameter of `model` from `params`, checking that nothing is missing, left
    over or of the wrong shape (errors name the parameter and `source`).

    `optional` lists path prefixes (e.g. `("pooler",)`) of parameters that `params` may lack:
    those keep the model's current (initial) values, as for a head a checkpoint does not have.
    """
    state = nnx.state(model, nnx.Param)
    expected = dict(nnx.to_flat_state(state))
    missing = sorted((p for p in set(expected) - set(params)
                      if not any(p[:len(prefix)] == prefix for prefix in optional)), key=str)
    extra = sorted(set(params) - set(expected), key=str)
    if missing or extra:
        raise ValueError(f"{source}: weights do not match the model: missing "
                         f"{[_name(p) for p in missing][:5]}, unexpected "
                         f"{[_name(p) for p in extra][:5]}")
    for path, var in expected.items():
        if path not in params:  # optional, keeps its value
            continue
        value = np.asarray(params[path])
        if value.shape != var[...].shape:
            raise ValueError(f"{source}: tensor for {_name(path)} has shape {value.shape}, "
                             f"the model expects {var[...].shape}")
        var[...] = jnp.asarray(value, var[...].dtype)


def stack_layers(params: Mapping[Path, np.ndarray]) -> dict[Path, np.ndarray]:
    """Per-layer paths (..., 'layers', i, ...) -> stacked paths (..., 'layers', ...) with a
    leading [num_layers] axis, the layout of a model built with `scan_layers=True`."""
    groups: dict[Path, dict[int, np.ndarray]] = {}
    stacked: dict[Path, np.ndarray] = {}
    for path, value in params.items():
        at = _layer_index(path)
        if at is None:
            stacked[path] = value
        else:
            groups.setdefault(path[:at] + path[at + 1:], {})[path[at]] = value
    for path, layers in groups.items():
        stacked[path] = np.stack([layers[i] for i in range(len(layers))])
    return stacked


def unstack_layers(params: Mapping[Path, np.ndarray]) -> dict[Path, np.ndarray]:
    """The inverse of `stack_layers`."""
    out: dict[Path, np.ndarray] = {}
    for path, value in params.items():
        if "layers" not in path:
            out[path] = value
            continue
        at = path.index("layers") + 1
        for i, layer in enumerate(value):
            out[(*path[:at], i, *path[at:])] = layer
    return out


def _layer_index(path: Path) -> int | None:
    """Position of the layer number in a per-layer path, or None."""
    if "layers" in path:
        at = path.index("layers") + 1
        if at < len(path) and isinstance(path[at], int):
            return at
    return None


def write_folder(folder: pathlib.Path, config: dict, tensors: Mapping[str, np.ndarray]) -> None:
    """Write config.json + model.safetensors atomically: into a temporary folder first, then
    renamed into place, so a failed save never leaves a half-written or clobbered checkpoint."""
    from safetensors.numpy import save_file

    folder = pathlib.Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} exists and is not a folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                  str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if folder.exists():
            backup = folder.with_name(f".{folder.name}.old")
            os.replace(folder, backup)
            os.replace(staging, folder)
            shutil.rmtree(backup)
        else:
            os.replace(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _name(path: Path) -> str:
    return "/".join(str(p) for p in path)
