"""Writing a tfx model as a transformers checkpoint folder, one output file at a time (what
`tfx.hf.save` does after checking that the architecture can express the model).

A family's `params_to_hf(params, config)` maps all parameters to all tensors at once. To hold
only one file's worth of parameters on the host, saving runs it once per file: the parameters
that file's tensors come from are gathered to the host (`jax.device_get`, or an all-gather
across processes), every other one is a stand-in that costs no memory (a zero-stride array of
its shape and dtype), and only that file's tensors are kept. Which parameters a tensor comes
from is read off the family's load plan (`steps`) for the tensors it writes: a tensor and the
parameters of one step belong together, as do the tensors of one step (a tied copy and its
original). A first run on stand-ins alone gives every tensor's name, shape and dtype.

Files are laid out as transformers' save_pretrained lays them out: `model.safetensors` alone,
or `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json` when the tensors
exceed `max_shard_size`, written by `tfx.hf.io.write_folder` (atomically, a tensor at a time),
with the model's `generation_config` as generation_config.json.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx

from tfx.generation.config import generation_config_of
from tfx.hf import io

__all__ = ["parse_size", "save_model"]

Path = tuple[str | int, ...]
_SINGLE = "model.safetensors"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def save_model(model: nnx.Module, folder: pathlib.Path, family, architecture: str,
               max_shard_size: int) -> None:
    """Write `model` as a folder of `architecture` (a name `family` saves), in files of at
    most `max_shard_size` bytes of tensors (a tensor larger than that gets a file alone), with
    generation_config.json when the model has a `generation_config`."""
    generation = None if getattr(model, "generation_config", None) is None else \
        {"generation_config.json": generation_config_of(model).to_hf()}
    config = model.config
    hf_config = family.config_to_hf(config, architecture)
    params = _per_layer(model)
    stand_ins = {path: np.broadcast_to(np.zeros((), np.dtype(array.dtype)),
                                       array.shape if row is None else array.shape[1:])
                 for path, (array, row) in params.items()}
    layout = family.params_to_hf(stand_ins, config)
    files = _files(layout, _sources(family.steps(list(layout), config), layout, params),
                   max_shard_size)

    def contents():  # each file's tensors, gathered only when the file is written
        for file, (names, needed) in files.items():
            gathered = {path: _gathered(*params[path]) for path in needed}
            tensors = family.params_to_hf(stand_ins | gathered, config)
            yield file, {name: tensors[name] for name in names}
            del gathered, tensors  # before the next file's are gathered

    io.write_folder(folder, hf_config, contents(), json_files=generation)


def _per_layer(model: nnx.Module) -> dict[Path, tuple[jax.Array, int | None]]:
    """Per-layer parameter path -> (the model's array, row of it or None): stacked layers
    (`scan_layers`) seen as the per-layer parameters that families name."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array = var.get_value()
        rows = range(array.shape[0]) if io.is_stacked(path) else [None]
        out.update({io.layer_path(path, row): (array, row) for row in rows})
    return out


def _gathered(array: jax.Array, row: int | None) -> np.ndarray:
    """(Row `row` of) a parameter on the host, gathered from its devices; on a CPU device it
    is the device buffer itself, not a copy."""
    if row is not None:
        array = array[row]  # sliced on the device: only this layer travels
    if not array.is_fully_addressable:
        from jax.experimental import multihost_utils

        array = multihost_utils.process_allgather(array, tiled=True)
    return np.asarray(jax.device_get(array))


def _sources(steps, layout: Mapping[str, np.ndarray], params: Mapping[Path, object]
             ) -> dict[str, frozenset[Path]]:
    """Tensor name -> the parameters its value comes from: those of the steps that connect
    it to parameters (through tensors shared by steps, as a tied copy and its original). A
    tensor no step names depends, to be safe, on every parameter."""
    group: dict[object, set] = {}  # tensor name or parameter path -> its group
    for step in steps:
        members = set().union({("tensor", n) for n in step.sources},
                              {("param", p) for p in step.targets},
                              *(group.get(("tensor", n), ()) for n in step.sources),
                              *(group.get(("param", p), ()) for p in step.targets))
        group.update(dict.fromkeys(members, members))
    everything = frozenset(params)
    return {name: frozenset(p for kind, p in group[("tensor", name)] if kind == "param")
            if ("tensor", name) in group else everything for name in layout}


def _files(layout: Mapping[str, np.ndarray], sources: Mapping[str, frozenset[Path]],
           limit: int) -> dict[str, tuple[list[str], frozenset[Path]]]:
    """File name -> (its tensors in `layout` order, the parameters they need). Tensors that
    share parameters share a file; files fill in order up to `limit` bytes."""
    groups: dict[frozenset, list[str]] = {}
    for name in layout:
        groups.setdefault(sources[name], []).append(name)
    shards: list[tuple[list[str], set, int]] = []
    for needed, names in groups.items():
        size = sum(np.asarray(layout[name]).nbytes for name in names)
        if not shards or (shards[-1][0] and shards[-1][2] + size > limit):
            shards.append(([], set(), 0))
        shards[-1] = (shards[-1][0] + names, shards[-1][1] | needed, shards[-1][2] + size)
    if len(shards) == 1:
        return {_SINGLE: (shards[0][0], frozenset(shards[0][1]))}
    return {f"model-{i:05d}-of-{len(shards):05d}.safetensors": (names, frozenset(needed))
            for i, (names, needed, _) in enumerate(shards, 1)}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size such as "5GB" (10^9) or "500MiB" (2^20), as transformers'
    max_shard_size takes them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, re.IGNORECASE) \
        if isinstance(size, str) else None
    if match:
        size = int(float(match[1]) * _UNITS[(match[2] or "").upper()])
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes or a size such "
                         f"as '5GB' or '500MiB', got {size!r}")
    return size
