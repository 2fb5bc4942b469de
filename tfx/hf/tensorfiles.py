"""The safetensors file format, read and written with numpy, a tensor at a time: a file is 8
bytes of little-endian header length, a JSON header (tensor name -> dtype code, shape, byte
offsets into the data; "__metadata__"), then the tensors' bytes, back to back.

Reading parses the header here (no data is read) and maps each tensor's bytes when it is asked
for, a tensor at a time; `host_array` gives the page-aligned memory a loaded parameter lives in;
writing makes only the tensor being written contiguous. Errors name the file and tensor at
fault.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import pathlib
from collections.abc import Mapping

import numpy as np

__all__ = ["DTYPES", "Entry", "copy_into", "header", "host_array", "numpy_dtype", "read", "write"]

# safetensors dtype codes -> numpy names, so that messages speak one language.
DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
          "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64",
          "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_CODES = {name: code for code, name in DTYPES.items()}
_ROWS = 16  # rows per block of a transposing copy (fastest here of 8 to 128)


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, numpy dtype name ("float32", "bfloat16", or the
    safetensors code of a dtype numpy lacks), shape, and the byte span [start, stop) of its data
    in the file."""

    file: pathlib.Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def header(path: pathlib.Path) -> dict[str, Entry]:
    """Tensor name -> `Entry`, from a safetensors file's header (no data is read); ValueError
    naming the file for anything that is not a well-formed header of this file."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            length = int.from_bytes(file.read(8), "little")
            if size < 8 or 8 + length > size:
                raise ValueError(f"a header of {length} bytes does not fit the file's {size}")
            fields = json.loads(file.read(length))
        if not isinstance(fields, dict):
            raise ValueError("the header is not a JSON object")
        fields.pop("__metadata__", None)
        return {name: _entry(path, name, field, 8 + length, size)
                for name, field in fields.items()}
    except OSError as error:
        message = error.strerror
    except (ValueError, TypeError) as error:  # JSONDecodeError and UnicodeDecodeError too
        message = str(error)
    raise ValueError(f"{path} is not a readable safetensors file: {message}") from None


def _entry(path: pathlib.Path, name: str, field, data: int, size: int) -> Entry:
    """The Entry of one header field (`data`: where the data starts, `size`: the file's);
    ValueError naming the tensor when it does not describe bytes inside the file."""
    offsets, shape, code = (field.get(key) if isinstance(field, dict) else None
                            for key in ("data_offsets", "shape", "dtype"))
    if not (isinstance(code, str) and _ints(shape) and _ints(offsets) and len(offsets) == 2
            and offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name!r} has no valid dtype, shape and data_offsets: "
                         f"{field!r}")
    dtype, shape = DTYPES.get(code, code), tuple(shape)
    start, stop = data + offsets[0], data + offsets[1]
    itemsize = numpy_dtype(dtype).itemsize if code in DTYPES else None
    if stop > size or (itemsize and stop - start != math.prod(shape) * itemsize):
        raise ValueError(f"tensor {name!r} ({dtype} {list(shape)}) has data_offsets "
                         f"{offsets} that do not fit it or the file")
    return Entry(path, dtype, shape, start, stop)


def _ints(value) -> bool:
    """A JSON list of non-negative integers."""
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def read(entry: Entry, name: str) -> np.ndarray:
    """Tensor `name` as a read-only numpy array over its file's pages (bfloat16 as ml_dtypes'
    bfloat16): a mapping of just its bytes, faulted in up front (MAP_POPULATE), gone when the
    array and every view of it are. Reading costs no copy, and no more memory than the page
    cache already holds, for as long as the array is kept."""
    dtype = numpy_dtype(entry.dtype)
    if entry.nbytes == 0:
        return np.empty(entry.shape, dtype)
    start = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY  # mappings start aligned
    try:
        with open(entry.file, "rb") as file:
            mapping = mmap.mmap(file.fileno(), entry.stop - start, offset=start,
                                flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                prot=mmap.PROT_READ)
    except (OSError, ValueError) as error:  # ValueError: the file is shorter than its header
        raise ValueError(f"{entry.file}: tensor {name!r} cannot be read: "
                         f"{getattr(error, 'strerror', None) or error}") from None
    return np.frombuffer(mapping, dtype, math.prod(entry.shape),
                         entry.start - start).reshape(entry.shape)


def host_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised numpy array in page-aligned memory of its own: an anonymous mapping,
    faulted in up front by the kernel (MAP_POPULATE, much faster than page by page).

    Why not np.empty: jax on CPU adopts an array aligned to 64 bytes without copying it, so a
    parameter assembled here becomes the device array at no further cost; and the memory goes
    back to the system when the array is dropped instead of staying in a heap that many large,
    differently lived allocations fragment. (Huge pages would speed a transposing copy into
    it, but the kernel's compaction to find them stalled loading for longer than they saved.)
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.uint8).view(dtype).reshape(shape)


def copy_into(out: np.ndarray, value: np.ndarray) -> np.ndarray:
    """out[...] = value, cast to out's dtype; returns out. A transposed 2-d view (torch's
    [out, in] weight seen as [in, out]) is copied in blocks of rows of its source: numpy's own
    copy of it strides across memory and runs several times slower."""
    value = np.asarray(value)
    if value.ndim != 2 or value.flags.c_contiguous or not value.T.flags.c_contiguous:
        np.copyto(out, value, casting="unsafe")
        return out
    source = value.T
    for start in range(0, source.shape[0], _ROWS):
        np.copyto(out[:, start:start + _ROWS], source[start:start + _ROWS].T, casting="unsafe")
    return out


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype of a numpy / ml_dtypes name ("float32", "bfloat16", "float8_e4m3fn")."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def write(path: pathlib.Path, tensors: Mapping[str, np.ndarray]) -> int:
    """Write a safetensors file (metadata format "pt", which transformers requires), one
    tensor at a time: only the tensor being written is made contiguous (copied, if it is a
    transposed view), never the file's worth. Returns the bytes of tensor data written."""
    fields, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, tensor in tensors.items():
        dtype = np.dtype(tensor.dtype).name
        if dtype not in _CODES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot hold")
        fields[name] = {"dtype": _CODES[dtype], "shape": list(np.shape(tensor)),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    blob = json.dumps(fields, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the format asks
    with open(path, "wb") as file:
        file.write(len(blob).to_bytes(8, "little") + blob)
        for tensor in tensors.values():
            tensor = np.asarray(tensor)
            if not tensor.flags.c_contiguous:  # a transposed view, say: copied, alone
                tensor = copy_into(np.empty(tensor.shape, tensor.dtype), tensor)
            file.write(tensor.reshape(-1).view(np.uint8).data)
    return offset
