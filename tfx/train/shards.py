"""Token shards: a corpus tokenized once into binary files, then read a window at a time.

This module defines the format and reads it: `open_shards` memory-maps one split of a shard
folder as a `ShardStream`, which has `TokenStream`'s interface and draws the very same batches
from the same tokens, so a run resumed at step k is bit-identical. `tfx.train.shard_writer`
writes the folders (`tokenize_to_shards`: text files, JSONL rows, Parquet rows, streamed
through a tokenizer, never holding the corpus). A shard folder:

    manifest.json        written last (temp file + rename): without it the folder is no shard set
    train-00000.bin ...  tokens, little-endian `dtype`; documents joined by the encoded "\\n\\n"
    train-docs.bin       int64 [documents]: where each document starts in the split's stream
    val-00000.bin ...    (and val-docs.bin) the same for the validation split

A document goes to val when the crc32 of its name (a text file's relative path, or
"<file>:<row>" for a JSONL / Parquet row) is below `val_fraction` of 2**32, so it keeps its side
whatever else the corpus holds; when no name is, the last training document goes to val.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import warnings

import numpy as np

from tfx.train.tokens import ByteTokenizer, HFTokenizer, TokenStream, _check_int

__all__ = ["Manifest", "ShardStream", "even_row_range", "is_shard_folder", "load_shard_corpus",
           "open_shards", "read_manifest", "shard_dtype", "tokenizer_identity"]

FORMAT, VERSION, MANIFEST, SEPARATOR = "tfx-token-shards", 1, "manifest.json", "\n\n"
SPLITS = ("train", "val")
_RERUN = "re-run the tokenization (tfx.train.shard_writer.tokenize_to_shards) into an empty folder"


def shard_dtype(vocab_size: int) -> np.dtype:
    """The little-endian dtype of the shards of a `vocab_size` tokenizer: the narrowest that
    holds every id (uint8 up to 256 ids, uint16 up to 65536, else uint32)."""
    return np.dtype("<u1" if vocab_size <= 2**8 else "<u2" if vocab_size <= 2**16 else "<u4")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What `manifest.json` holds. `tokenizer`: "byte" or "sha256:<hex digest of its
    tokenizer.json>"; `dtype`: a numpy name, stored little-endian; `separator`: the ids between
    documents; `splits`: {"train" | "val": {"tokens", "documents": int, "shards": [{"file",
    "count", "sha256"}], "starts": {"file", "count", "sha256"}}} (count: items in the file)."""

    version: int
    tokenizer: str
    tokenizer_name: str
    vocab_size: int
    dtype: str
    separator: list[int]
    val_fraction: float
    sources: list[str]
    splits: dict[str, dict]

    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}


def tokenizer_identity(tokenizer) -> tuple[str, str]:
    """(identity, readable name) of a ByteTokenizer or HFTokenizer; the identity changes
    whenever the ids a text encodes to could."""
    if isinstance(tokenizer, ByteTokenizer):  # specials never come out of encode
        return "byte", "byte"
    if isinstance(tokenizer, HFTokenizer):
        digest = hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()
        return f"sha256:{digest}", str(tokenizer.path)
    raise TypeError(f"tokenizer must be a ByteTokenizer or HFTokenizer, got {tokenizer!r}")


def is_shard_folder(data: str | os.PathLike | None) -> bool:
    """Whether `data` is a shard folder, finished (a manifest of this format) or not (a first
    train shard without one: `open_shards` then says to re-run the tokenization)."""
    if data is None or data == "stdlib" or not pathlib.Path(data).is_dir():
        return False
    try:
        return json.loads((pathlib.Path(data) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return (pathlib.Path(data) / "train-00000.bin").is_file()


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """The Manifest of a finished shard folder of this format version (ValueError otherwise)."""
    path = pathlib.Path(folder) / MANIFEST
    if not path.is_file():
        raise ValueError(f"data: {str(folder)!r} has no {MANIFEST}, so it is not a finished "
                         f"shard set (an interrupted tokenization leaves none); {_RERUN}")
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"it is {data.get('format')!r} format version "
                             f"{data.get('version')!r}; this tfx reads {FORMAT!r} version "
                             f"{VERSION}")
        return Manifest(**{f.name: data[f.name] for f in dataclasses.fields(Manifest)})
    except (ValueError, KeyError, AttributeError) as err:
        raise ValueError(f"data: {str(path)!r} is not a readable shard manifest ({err}); "
                         f"{_RERUN}") from None


def open_shards(folder: str | os.PathLike, tokenizer, split: str = "train", *,
                verify: bool = False) -> ShardStream:
    """One split ("train" or "val") of a shard folder as a memory-mapped `ShardStream`.

    Checks that `tokenizer` is the one the shards were made with and that each file of the
    split is there with the size the manifest gives; `verify=True` also reads each file once to
    compare its sha256 (a check after copying a shard set, too slow for every start).

    Raises:
      ValueError: naming the folder or file and saying to re-run the tokenization.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    manifest = read_manifest(folder)
    identity, name = tokenizer_identity(tokenizer)
    if identity != manifest.tokenizer:
        raise ValueError(f"data: the shards in {str(folder)!r} were made with tokenizer "
                         f"{manifest.tokenizer_name!r} ({manifest.tokenizer}), not {name!r} "
                         f"({identity}); use that tokenizer, or {_RERUN} with this one")
    info, itemsize = manifest.splits[split], np.dtype(manifest.dtype).itemsize
    for file, size in [(s, itemsize) for s in info["shards"]] + [(info["starts"], 8)]:
        _check_file(pathlib.Path(folder) / file["file"], file, size, verify)
    return ShardStream(pathlib.Path(folder), split, manifest)


def _check_file(path: pathlib.Path, file: dict, itemsize: int, verify: bool) -> None:
    if not path.is_file():
        raise ValueError(f"data: shard {str(path)!r} is missing; {_RERUN}")
    size, expected = path.stat().st_size, file["count"] * itemsize
    if size != expected:
        raise ValueError(f"data: shard {str(path)!r} is damaged: {size} bytes, the manifest "
                         f"says {expected}; {_RERUN}")
    if verify:
        with open(path, "rb") as data:
            digest = hashlib.file_digest(data, "sha256")
        if digest.hexdigest() != file["sha256"]:
            raise ValueError(f"data: shard {str(path)!r} is damaged: its sha256 differs from "
                             f"the manifest's; {_RERUN}")


def load_shard_corpus(folder: str | os.PathLike, tokenizer, *, val_fraction: float = 0.05,
                      ) -> tuple[ShardStream, ShardStream]:
    """(train, val) streams of a shard folder, as `tfx.train.data.load_corpus` returns them;
    the split was made when tokenizing, so another `val_fraction` only warns."""
    train = open_shards(folder, tokenizer, "train")
    if val_fraction != train.manifest.val_fraction:
        warnings.warn(f"data.val_fraction={val_fraction} is not used: the shards in "
                      f"{str(folder)!r} were split with {train.manifest.val_fraction} when "
                      "tokenized", UserWarning, stacklevel=2)
    return train, open_shards(folder, tokenizer, "val")


def even_row_range(batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    """[start, stop) of process `process_index`'s rows when a batch is cut into equal
    contiguous blocks, one per process: what `tfx.parallel.process_row_range` gives for a batch
    sharding over devices in process order (as jax.devices() lists them), as many per process."""
    process_count = _check_int("process_count", process_count, 1)
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
    if batch_size % process_count:
        raise ValueError(f"batch_size ({batch_size}) must be a multiple of process_count "
                         f"({process_count})")
    rows = batch_size // process_count
    return process_index * rows, (process_index + 1) * rows


def _map(path: pathlib.Path, dtype: np.dtype) -> np.ndarray:
    """The file as a read-only array backed by a memory map. MADV_RANDOM: Linux otherwise reads
    read_ahead_kb (often MiBs) around each page touched, for a window of a few KiB."""
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype)


class ShardStream:
    """One split of a shard folder as a token stream: `TokenStream`'s interface (`len`,
    `windows`, `batch`, `eval_batches`; `mlm_batch` takes it too) over memory maps of the
    shards, so a batch reads only the pages of its windows, whatever the corpus's size."""

    def __init__(self, folder: pathlib.Path, split: str, manifest: Manifest):
        info, dtype = manifest.splits[split], np.dtype(manifest.dtype).newbyteorder("<")
        self.folder, self.split, self.manifest = folder, split, manifest
        self.shards = [_map(folder / s["file"], dtype) for s in info["shards"]]
        self.bounds = np.cumsum([0] + [s["count"] for s in info["shards"]])  # int64 [shards + 1]

    def __repr__(self) -> str:
        return f"ShardStream({str(self.folder)!r}, {self.split!r}, {len(self)} tokens)"

    def __len__(self) -> int:
        return int(self.bounds[-1])

    @property
    def document_starts(self) -> np.ndarray:
        """int64 [documents]: where each document starts; it ends where the separator before
        the next one starts (the last at the end of the stream)."""
        return np.memmap(self.folder / self.manifest.splits[self.split]["starts"]["file"], "<i8",
                         "r")

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """int [N] start offsets -> int32 [N, width]: tokens[start : start + width] per row,
        read from the shard or shards each window lies in."""
        starts = np.asarray(starts).reshape(-1)
        if len(self) < width:
            raise ValueError(f"seq_len: the stream holds {len(self)} tokens, fewer than the "
                             f"{width} one window needs; use a shorter seq_len or more text")
        if starts.size and (starts.min() < 0 or starts.max() > len(self) - width):
            raise ValueError(f"starts must be in [0, {len(self) - width}] for windows of "
                             f"{width} tokens, got values in [{starts.min()}, {starts.max()}]")
        out = np.empty((len(starts), width), np.int32)
        first = np.searchsorted(self.bounds, starts, side="right") - 1  # each window's 1st shard
        for row, (start, shard) in enumerate(zip(starts.tolist(), first.tolist(), strict=True)):
            done = 0
            while done < width:  # a window across a shard boundary takes a piece of each
                offset = start + done - int(self.bounds[shard])
                piece = self.shards[shard][offset:offset + width - done]
                out[row, done:done + len(piece)] = piece
                done, shard = done + len(piece), shard + 1
        return out

    # The training and validation windows: TokenStream's own functions (they only call len and
    # windows), so the batches match too, and `batch(rows=)` reads only those rows' windows.
    batch_starts = TokenStream.batch_starts
    batch = TokenStream.batch
    eval_batches = TokenStream.eval_batches
