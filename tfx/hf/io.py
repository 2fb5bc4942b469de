"""Files of a Hugging Face checkpoint folder, and moving arrays in and out of an NNX model.

Reads `config.json`, `generation_config.json` and safetensors weights (`tfx.hf.tensorfiles`:
headers first, then each tensor mapped when it is asked for); refuses pickle checkpoints. Every
failure names the file or tensor at fault. Which files hold the weights (what transformers'
save_pretrained writes, and nothing else):

- with `model.safetensors.index.json`: the shards its "weight_map" names, each tensor read only
  from the shard the index maps it to. Tensors a shard holds that the index does not map to it,
  and `*.safetensors` files the index does not name, are not read.
- without an index: `model.safetensors`, alone. Other `*.safetensors` files beside it (an
  adapter, a stray copy) are not read; a folder with other `*.safetensors` files but no
  `model.safetensors` is refused, naming them, and so is a folder with both
  `model.safetensors` and an index (which of the two is the checkpoint is ambiguous).

Every file read lies in the folder: index entries that are absolute or contain `..`, and
symlinks resolving outside the folder, are refused, except that a Hugging Face cache snapshot
(`<repo>/snapshots/<revision>/`) may link into its own `<repo>/blobs/`, as the hub's cache does.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.generation.config import GenerationConfig
from tfx.hf import tensorfiles
from tfx.nn.paths import path_name

__all__ = ["Checkpoint", "assign_params", "flat_params", "inside", "is_stacked", "layer_path",
           "read_config", "read_generation_config", "read_json", "read_tensors", "split_layer",
           "stack_layers", "unstack_layers", "write_folder"]

Path = tuple[str | int, ...]
_PICKLES = ("pytorch_model.bin", "model.bin", "pytorch_model.bin.index.json", "model.pt",
            "tf_model.h5", "flax_model.msgpack")
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
_GENERATION = "generation_config.json"
_JSON_KINDS = {dict: "object", list: "array", str: "string", int: "number", float: "number",
               bool: "true/false", type(None): "null"}


def read_config(folder: pathlib.Path) -> dict:
    """The parsed config.json of a checkpoint folder."""
    if not folder.is_dir():
        raise ValueError(f"checkpoint path {folder} is not a folder (expected what "
                         "transformers' save_pretrained writes: config.json + *.safetensors)")
    path = inside(folder, "config.json", f"{folder / 'config.json'}")
    return read_json(path, dict, "a checkpoint folder needs its config.json")


def read_generation_config(folder: pathlib.Path) -> GenerationConfig:
    """The decoding defaults of a checkpoint folder: its generation_config.json, else (as
    transformers' `GenerationConfig.from_model_config`) the same fields of its config.json,
    those it leaves out or sets to null taken from its "text_config" (a multimodal
    checkpoint's text model), each over transformers' defaults (`tfx.generation.config`).
    ValueError names the file and field at fault."""
    path = inside(folder, _GENERATION, str(folder / _GENERATION))
    if path.is_file():
        return GenerationConfig.from_hf(read_json(path, dict, ""), str(path))
    path = inside(folder, "config.json", str(folder / "config.json"))
    fields = read_json(path, dict, "a checkpoint folder needs its config.json")
    text = fields.get("text_config")
    if isinstance(text, dict):
        fields = {**text, **{key: value for key, value in fields.items() if value is not None}}
    return GenerationConfig.from_hf(fields, str(path))


def read_json(path: pathlib.Path, kind: type, missing: str) -> dict | list:
    """Parse a UTF-8 JSON file that must hold a `kind` (dict: a JSON object, or list: an array);
    `missing` says why it must exist when it does not. Errors name `path` and what is wrong
    (unreadable, not UTF-8, not JSON, a key given twice, the wrong kind of value)."""
    if not path.is_file():
        raise ValueError(f"{path} is missing: {missing}")
    try:
        text = path.read_bytes().decode("utf-8")
        value = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, path))
    except OSError as error:
        raise ValueError(f"{path} cannot be read: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); "
                         "expected a JSON file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path} must hold a JSON {_JSON_KINDS[kind]}, got a JSON "
                         f"{_JSON_KINDS.get(type(value), type(value).__name__)}")
    return value


def _unique_keys(pairs: list[tuple[str, object]], path: pathlib.Path) -> dict:
    # json.loads keeps the last of repeated keys; a file that says two things is refused.
    value = dict(pairs)
    if len(value) < len(pairs):
        twice = sorted({key for key, _ in pairs if sum(k == key for k, _ in pairs) > 1})
        raise ValueError(f"{path} gives the key(s) {twice} more than once in one JSON object")
    return value


def inside(folder: pathlib.Path, entry: str, what: str) -> pathlib.Path:
    """`folder / entry`, refused (ValueError naming `what`) when it is not a relative path
    inside `folder` or is a symlink resolving outside it (a hub cache snapshot's links into
    its own blobs/ excepted). The file need not exist."""
    parts = pathlib.PurePath(entry).parts
    if not entry or pathlib.PurePath(entry).is_absolute() or ".." in parts:
        raise ValueError(f"{what}: {entry!r} is not a file name inside {folder} (absolute "
                         "paths and '..' are refused: a checkpoint reads only its own files)")
    path, root = folder / entry, folder.resolve()
    resolved = path.resolve()
    hub_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if not (resolved.is_relative_to(root) or resolved.parent == hub_blobs):
        raise ValueError(f"{what}: {entry!r} is a symlink resolving to {resolved}, outside "
                         f"{folder} (a checkpoint reads only its own files: copy the file in)")
    return path


class Checkpoint(Mapping):
    """A checkpoint's tensors by name, read lazily: the safetensors headers (names, dtypes,
    shapes, offsets) are read up front, a tensor's data only when it is looked up, and only
    from the one file the tensor belongs to.

    `checkpoint[name]` -> read-only numpy array over the file's pages (`tensorfiles.read`;
    bfloat16 as ml_dtypes' bfloat16), unmapped when it is dropped.
    `checkpoint.entries[name]` -> its `tensorfiles.Entry` (file, dtype, shape, offsets);
    `checkpoint.dtypes[name]` -> its numpy dtype name, from the header.
    """

    def __init__(self, entries: Mapping[str, tensorfiles.Entry]):
        self.entries = dict(entries)
        self.dtypes = {name: entry.dtype for name, entry in self.entries.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        return tensorfiles.read(self.entries[name], name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def read_tensors(folder: pathlib.Path) -> Checkpoint:
    """The tensors of the folder's safetensors file(s), by name (see the module docstring for
    which files are read). Only headers are read here; see `Checkpoint`."""
    index = inside(folder, _INDEX, str(folder / _INDEX))
    single = inside(folder, _SINGLE, str(folder / _SINGLE))
    if index.is_file() and single.is_file():
        raise ValueError(f"{folder} holds both {_SINGLE} and {_INDEX}: which one is the "
                         "checkpoint is ambiguous; remove the one that is not")
    shards = _index(folder, index) if index.is_file() else _unindexed(folder, single)
    entries = {}
    for path, names in shards.items():
        header = tensorfiles.header(path)
        absent = sorted(set(names or header) - set(header))
        if absent:
            raise ValueError(f"{index} maps tensor(s) {absent[:5]} ({len(absent)} in all) to "
                             f"{path.name}, which does not hold them")
        entries.update((name, header[name]) for name in names or header)
    return Checkpoint(entries)


def _index(folder: pathlib.Path, index: pathlib.Path) -> dict[pathlib.Path, list[str]]:
    """Shard path -> the tensor names the index maps to it."""
    weight_map = read_json(index, dict, "").get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(file, str) for file in weight_map.values())):
        raise ValueError(f"{index} is not a valid safetensors index: it needs a non-empty "
                         "\"weight_map\" of tensor name -> shard file name")
    shards: dict[pathlib.Path, list[str]] = {}
    for name, entry in weight_map.items():
        path = inside(folder, entry, f"{index} (weight_map entry of {name!r})")
        if not path.is_file():
            raise ValueError(f"{path} is listed in the index but missing")
        shards.setdefault(path, []).append(name)
    return shards


def _unindexed(folder: pathlib.Path, single: pathlib.Path) -> dict[pathlib.Path, None]:
    """{model.safetensors: None} (None: every tensor it holds), or why there is none."""
    if single.is_file():
        return {single: None}
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        raise ValueError(f"{folder} has no {_SINGLE} and no {_INDEX}, only {others}: without "
                         f"an index tfx reads {_SINGLE} alone (what save_pretrained writes; "
                         "sharded checkpoints come with their index)")
    pickles = [name for name in _PICKLES if (folder / name).exists()]
    if pickles:
        raise ValueError(
            f"{folder} holds only pickle weights ({', '.join(pickles)}); tfx reads "
            "safetensors only. Convert with transformers: "
            "AutoModel.from_pretrained(path).save_pretrained(path, safe_serialization=True)")
    raise ValueError(f"{folder} has no *.safetensors weights")


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
                         f"{[path_name(p) for p in missing][:5]}, unexpected "
                         f"{[path_name(p) for p in extra][:5]}")
    for path, var in expected.items():
        if path not in params:  # optional, keeps its value
            continue
        value = np.asarray(params[path])
        if value.shape != var[...].shape:
            raise ValueError(f"{source}: tensor for {path_name(path)} has shape {value.shape}, "
                             f"the model expects {var[...].shape}")
        var[...] = jnp.asarray(value, var[...].dtype)


def stack_layers(params: Mapping[Path, np.ndarray]) -> dict[Path, np.ndarray]:
    """Per-layer paths (..., 'layers', i, ...) -> stacked paths (..., 'layers', ...) with a
    leading [num_layers] axis, the layout of a model built with `scan_layers=True`."""
    groups: dict[Path, dict[int, np.ndarray]] = {}
    stacked: dict[Path, np.ndarray] = {}
    for path, value in params.items():
        kind, row = split_layer(path)
        if row is None:
            stacked[path] = value
        else:
            groups.setdefault(kind, {})[row] = value
    for path, layers in groups.items():
        stacked[path] = np.stack([layers[i] for i in range(len(layers))])
    return stacked


def unstack_layers(params: Mapping[Path, np.ndarray]) -> dict[Path, np.ndarray]:
    """The inverse of `stack_layers`."""
    out: dict[Path, np.ndarray] = {}
    for path, value in params.items():
        if not is_stacked(path):
            out[path] = value
            continue
        for i, layer in enumerate(value):
            out[layer_path(path, i)] = layer
    return out


def split_layer(path: Path) -> tuple[Path, int | None]:
    """A per-layer path (..., 'layers', i, ...) -> (the stacked path (..., 'layers', ...), i);
    any other path -> (path, None)."""
    if "layers" in path:
        at = path.index("layers") + 1
        if at < len(path) and isinstance(path[at], int):
            return path[:at] + path[at + 1:], path[at]
    return path, None


def layer_path(stacked: Path, row: int | None) -> Path:
    """The inverse of `split_layer`: row `row` of a stacked path as a per-layer path."""
    if row is None:
        return stacked
    at = stacked.index("layers") + 1
    return (*stacked[:at], row, *stacked[at:])


def is_stacked(path: Path) -> bool:
    """Whether a parameter path is that of layers stacked [num_layers, ...] (`scan_layers`)."""
    return "layers" in path and split_layer(path)[1] is None


def write_folder(folder: pathlib.Path, config: dict,
                 tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, Mapping]], *,
                 json_files: Mapping[str, dict] | None = None) -> None:
    """Write a checkpoint folder atomically: config.json and the weights go into a temporary
    folder beside `folder`, which is then renamed into place (replacing an existing one only
    then), so a failed save never leaves a half-written or clobbered checkpoint behind.

    Args:
      tensors: the weights, by name: one `model.safetensors`; or (file name, tensors) pairs,
        one per file, taken one at a time (a generator can gather each file's tensors when its
        turn comes), with `model.safetensors.index.json` when there are several.
      json_files: more JSON files to write beside config.json, by file name (e.g.
        generation_config.json).
    """
    folder = pathlib.Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} exists and is not a folder")
    files = [(_SINGLE, tensors)] if isinstance(tensors, Mapping) else tensors
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        weight_map, total = {}, 0
        for file, shard in files:
            total += tensorfiles.write(staging / file, shard)
            weight_map.update(dict.fromkeys(shard, file))
            del shard  # held no longer than its file takes to write
        if len(set(weight_map.values())) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        for name, value in {"config.json": config, **(json_files or {})}.items():
            (staging / name).write_text(json.dumps(value, indent=2, sort_keys=True))
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
