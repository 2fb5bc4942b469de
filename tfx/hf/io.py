"""Files of a Hugging Face checkpoint folder, and moving arrays in and out of an NNX model.

Reads `config.json` and safetensors weights with numpy; refuses pickle checkpoints. Every
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
from collections.abc import Iterator, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.nn.paths import path_name

__all__ = ["Checkpoint", "assign_params", "current_values", "flat_params", "read_config",
           "read_json", "read_tensors", "stack_layers", "unstack_layers", "write_folder"]

Path = tuple[str | int, ...]
_PICKLES = ("pytorch_model.bin", "model.bin", "pytorch_model.bin.index.json", "model.pt",
            "tf_model.h5", "flax_model.msgpack")
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
# safetensors dtype codes -> numpy names, so that messages speak one language.
_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
           "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64",
           "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_JSON_KINDS = {dict: "object", list: "array", str: "string", int: "number", float: "number",
               bool: "true/false", type(None): "null"}


def read_config(folder: pathlib.Path) -> dict:
    """The parsed config.json of a checkpoint folder."""
    if not folder.is_dir():
        raise ValueError(f"checkpoint path {folder} is not a folder (expected what "
                         "transformers' save_pretrained writes: config.json + *.safetensors)")
    path = inside(folder, "config.json", f"{folder / 'config.json'}")
    return read_json(path, dict, "a checkpoint folder needs its config.json")


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
    """A checkpoint's tensors by name, read lazily: the safetensors headers (names, dtypes) are
    read up front, a tensor's data only when it is looked up, and only from the one file the
    tensor belongs to.

    `checkpoint[name]` -> numpy array (bfloat16 as ml_dtypes' bfloat16);
    `checkpoint.dtypes[name]` -> its numpy dtype name ("float32", "int8", ...), from the header.
    """

    def __init__(self, files: Mapping[str, pathlib.Path], dtypes: Mapping[str, str]):
        self.files, self.dtypes = dict(files), dict(dtypes)

    def __getitem__(self, name: str) -> np.ndarray:
        from safetensors import SafetensorError, safe_open

        path = self.files[name]
        try:
            with safe_open(str(path), "numpy") as file:
                return file.get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path}: tensor {name!r} cannot be read: {error}") from None

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def read_tensors(folder: pathlib.Path) -> Checkpoint:
    """The tensors of the folder's safetensors file(s), by name (see the module docstring for
    which files are read). Only headers are read here; see `Checkpoint`."""
    index = inside(folder, _INDEX, str(folder / _INDEX))
    single = inside(folder, _SINGLE, str(folder / _SINGLE))
    if index.is_file() and single.is_file():
        raise ValueError(f"{folder} holds both {_SINGLE} and {_INDEX}: which one is the "
                         "checkpoint is ambiguous; remove the one that is not")
    shards = _index(folder, index) if index.is_file() else _unindexed(folder, single)
    files, dtypes = {}, {}
    for path, names in shards.items():
        header = _header(path)
        absent = sorted(set(names or header) - set(header))
        if absent:
            raise ValueError(f"{index} maps tensor(s) {absent[:5]} ({len(absent)} in all) to "
                             f"{path.name}, which does not hold them")
        for name in names or header:
            files[name], dtypes[name] = path, header[name]
    return Checkpoint(files, dtypes)


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


def _header(path: pathlib.Path) -> dict[str, str]:
    """Tensor name -> numpy dtype name, from a safetensors file's header (no data is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "numpy") as file:
            names = file.keys()  # a safe_open is not iterable
            codes = {name: file.get_slice(name).get_dtype() for name in names}
            return {name: _DTYPES.get(code, code) for name, code in codes.items()}
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from None


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


def current_values(model: nnx.Module, paths: list[Path]) -> dict[Path, np.ndarray]:
    """The model's own (e.g. initial) values of per-layer parameter `paths`, whether its layers
    are stacked (`scan_layers`: row i of (..., 'layers', ...)) or not."""
    state = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    values = {}
    for path in paths:
        at = _layer_index(path)
        if path in state or at is None:
            values[path] = np.asarray(state[path][...])
        else:
            values[path] = np.asarray(state[path[:at] + path[at + 1:]][...][path[at]])
    return values


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
