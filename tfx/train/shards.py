"""Token shards: a corpus tokenized once into binary files, then read a window at a time.

`tokenize_to_shards` streams documents (text files, JSONL rows, Parquet rows) through a
tokenizer into fixed-size shard files, never holding the corpus; `open_shards` memory-maps one
split back as a `ShardStream`, which has `TokenStream`'s interface and draws the very same
batches from the same tokens, so a run resumed at step k is bit-identical. A shard folder:

    manifest.json        written last (temp file + rename): without it the folder is no shard set
    train-00000.bin ...  tokens, little-endian `dtype`; documents joined by the encoded "\\n\\n"
    train-docs.bin       int64 [documents]: where each document starts in the split's stream
    val-00000.bin ...    (and val-docs.bin) the same for the validation split

A document goes to val when the crc32 of its name (a text file's relative path, or
"<file>:<row>" for a JSONL / Parquet row) is below `val_fraction` of 2**32, so it keeps its side
whatever else the corpus holds; when no name is, the last training document goes to val.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import re
import time
import warnings
import zlib
from collections.abc import Iterator, Sequence

import numpy as np
import tokenizers

from tfx.train import data as _data
from tfx.train.data import ByteTokenizer, HFTokenizer, Text, TokenStream

__all__ = ["Manifest", "ShardStream", "even_row_range", "is_shard_folder", "load_shard_corpus",
           "open_shards", "read_manifest", "tokenize_to_shards", "tokenizer_identity"]

FORMAT, VERSION, MANIFEST, SEPARATOR = "tfx-token-shards", 1, "manifest.json", "\n\n"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 2**27  # 256 MiB of uint16: few files, each far larger than a batch
_BATCH_DOCS, _BATCH_CHARS = 1024, 16 * 2**20  # per encode_batch call: bounded memory, all cores
_OWN_FILES = re.compile(r"(train|val)-(\d{5,}|docs)\.bin|manifest\.json(\.tmp)?")
_RERUN = "re-run the tokenization (tfx.train.shards.tokenize_to_shards) into an empty folder"


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


# ---------------------------------------------------------------------------------------------
# Writing


def _documents(sources: Sequence[str | os.PathLike], text_field: str,
               skipped: collections.Counter) -> Iterator[Text]:
    """(name, text) of every document, streamed: "stdlib", text files and folders as
    `text_files` reads them, except that `.jsonl` and `.parquet` files hold one per row."""
    for source in sources:
        if source == "stdlib":
            yield from _data.stdlib_texts()
            continue
        root = pathlib.Path(source)
        if root.is_file():
            files = [(root.name, root)]
        elif root.is_dir():
            files = [(rel, p) for rel, p in _data._files_under(
                root, lambda d: d.startswith(".") or d == "__pycache__")
                if not p.name.startswith(".")]
        else:
            raise ValueError(f"sources: {str(source)!r} does not exist")
        for rel, path in files:
            rows = {".jsonl": _jsonl_rows, ".parquet": _parquet_rows}.get(path.suffix)
            if rows is not None:
                yield from rows(rel, path, text_field)
                continue
            try:
                text, reason = _data._decode(path.read_bytes())
            except OSError:
                text, reason = None, "unreadable"
            if text is None:
                skipped[reason] += 1
            else:
                yield rel, text


def _jsonl_rows(rel: str, path: pathlib.Path, field: str) -> Iterator[Text]:
    with open(path, "rb") as lines:  # json.loads decodes (bad UTF-8 is a ValueError)
        for row, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[field]
            except (ValueError, KeyError, TypeError, IndexError):
                text = None
            if not isinstance(text, str):
                raise ValueError(f"sources: {str(path)!r} line {row + 1} is not a JSON object "
                                 f"with a string field {field!r} (choose it with text_field)")
            yield f"{rel}:{row}", text


def _parquet_rows(rel: str, path: pathlib.Path, field: str) -> Iterator[Text]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ValueError(f"sources: reading {str(path)!r} needs pyarrow (pip install pyarrow)"
                         ) from err
    table = pq.ParquetFile(path)
    column = table.schema_arrow.field(field) if field in table.schema_arrow.names else None
    if column is None or column.type not in ("string", "large_string"):
        raise ValueError(f"sources: {str(path)!r} has no column {field!r} of strings (choose "
                         f"it with text_field; columns: {table.schema_arrow.names})")
    row = 0
    for batch in table.iter_batches(batch_size=128, columns=[field]):  # rows, not row groups
        for text in batch.column(0).to_pylist():
            yield f"{rel}:{row}", text or ""
            row += 1


def _batches(documents: Iterator[Text], skipped: collections.Counter) -> Iterator[list[Text]]:
    """The non-blank documents in lists of at most _BATCH_DOCS or about _BATCH_CHARS."""
    batch, chars = [], 0
    for name, text in documents:
        if not text.strip():
            skipped["blank"] += 1
            continue
        batch.append((name, text))
        chars += len(text)
        if len(batch) == _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encoder(tokenizer, dtype: np.dtype):
    """texts -> their ids as `dtype` arrays: the ids `tokenizer.encode` gives, faster."""
    if isinstance(tokenizer, ByteTokenizer):
        return lambda texts: [np.frombuffer(t.encode(), np.uint8).astype(dtype) for t in texts]
    inner = tokenizers.Tokenizer.from_file(str(tokenizer.path))
    # encode_batch spreads the texts over every core; the _fast form skips character offsets.
    encode = getattr(inner, "encode_batch_fast", inner.encode_batch)
    return lambda texts: [np.asarray(e.ids, dtype) for e in encode(texts, add_special_tokens=False)]


class _File:
    """A file written in pieces, its sha256 kept as it goes."""

    def __init__(self, path: pathlib.Path):
        self.path, self.count, self._hash = path, 0, hashlib.sha256()
        self._out = open(path, "wb")  # noqa: SIM115 (open across appends; close() closes it)

    def write(self, array: np.ndarray) -> None:
        data = array.tobytes()
        self._out.write(data)
        self._hash.update(data)
        self.count += len(array)

    def close(self) -> dict:
        self._out.flush()
        os.fsync(self._out.fileno())  # on disk before the manifest that vouches for it
        self._out.close()
        return {"file": self.path.name, "count": self.count, "sha256": self._hash.hexdigest()}


class _SplitWriter:
    """Appends documents to one split's shard files and document starts."""

    def __init__(self, folder: pathlib.Path, split: str, separator: np.ndarray,
                 shard_tokens: int):
        self.folder, self.split, self.separator = folder, split, separator
        self.shard_tokens, self.tokens, self.shards, self._shard = shard_tokens, 0, [], None
        self.starts = _File(folder / f"{split}-docs.bin")

    def append(self, tokens: np.ndarray) -> None:
        if self.starts.count:
            self._write(self.separator)
        self.starts.write(np.array([self.tokens], "<i8"))
        self._write(tokens)

    def _write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._shard is None or self._shard.count == self.shard_tokens:
                self._close_shard()
                self._shard = _File(self.folder / f"{self.split}-{len(self.shards):05d}.bin")
            piece = tokens[:self.shard_tokens - self._shard.count]
            self._shard.write(piece)
            self.tokens += len(piece)
            tokens = tokens[len(piece):]

    def _close_shard(self) -> None:
        if self._shard is not None:
            self.shards.append(self._shard.close())

    def close(self) -> dict:
        self._close_shard()
        return {"tokens": self.tokens, "documents": self.starts.count, "shards": self.shards,
                "starts": self.starts.close()}


def _empty_out_dir(out_dir: str | os.PathLike) -> pathlib.Path:
    """`out_dir`, created or emptied of an earlier shard set (its manifest first)."""
    folder = pathlib.Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"out_dir: {str(out_dir)!r} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    foreign = sorted(p.name for p in folder.iterdir() if not _OWN_FILES.fullmatch(p.name))
    if foreign:
        raise ValueError(f"out_dir: {str(out_dir)!r} holds files that are not token shards "
                         f"({', '.join(foreign[:3])}); choose an empty or new folder")
    for path in sorted(folder.iterdir(), key=lambda p: p.name != MANIFEST):
        path.unlink()
    return folder


def tokenize_to_shards(sources: Sequence[str | os.PathLike], tokenizer, out_dir,
                       *, val_fraction: float = 0.05, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                       progress: bool = True, text_field: str = "text") -> Manifest:
    """Tokenize `sources` once into the shard folder `out_dir` (layout: see the module).

    Args:
      sources: one or a list of: "stdlib", text files or folders (read as
        `tfx.train.data.text_files` reads them; a text file is one document, read whole),
        `.jsonl` files (field `text_field` of each row) and `.parquet` files (string column
        `text_field`, read in batches of rows).
        Blank documents are left out; skipped ones are counted in a UserWarning.
      tokenizer: a ByteTokenizer or HFTokenizer. Shards are uint8 up to 256 ids, uint16 up to
        65536, else uint32.
      out_dir: a new or empty folder, or one holding an earlier shard set (replaced).
      shard_tokens: tokens per shard file (the last of a split holds the rest).
    Returns:
      the Manifest written to `out_dir/manifest.json`, last, so an interrupted run leaves none.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    sources = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    shard_tokens = _data._check_int("shard_tokens", shard_tokens, 1)
    identity, name = tokenizer_identity(tokenizer)
    vocab = tokenizer.vocab_size
    dtype = np.dtype("<u1" if vocab <= 2**8 else "<u2" if vocab <= 2**16 else "<u4")
    for source in sources:  # its own shards would be read back as it writes them
        if source != "stdlib" and pathlib.Path(out_dir).resolve().is_relative_to(
                pathlib.Path(source).resolve()):
            raise ValueError(f"out_dir: {str(out_dir)!r} lies inside source {str(source)!r}")
    folder = _empty_out_dir(out_dir)
    separator = tokenizer.encode(SEPARATOR).astype(dtype)
    writers = {s: _SplitWriter(folder, s, separator, shard_tokens) for s in SPLITS}
    skipped = collections.Counter()
    _write_documents(_batches(_documents(sources, text_field, skipped), skipped),
                     _encoder(tokenizer, dtype), writers, val_fraction, progress)
    if skipped:
        warnings.warn(f"sources: skipped {sum(skipped.values())} documents ("
                      + ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())) + ")",
                      UserWarning, stacklevel=2)
    if not writers["train"].starts.count:
        raise ValueError(f"sources {[str(s) for s in sources]} hold "
                         f"{writers['val'].starts.count} document(s); a train and a val split "
                         "need at least two")
    manifest = Manifest(VERSION, identity, name, vocab, dtype.name, separator.tolist(),
                        val_fraction, [str(s) for s in sources],
                        {s: w.close() for s, w in writers.items()})
    temporary = folder / (MANIFEST + ".tmp")
    with open(temporary, "w") as out:
        json.dump(manifest.to_json(), out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, folder / MANIFEST)
    return manifest


def _write_documents(batches: Iterator[list[Text]], encode, writers: dict[str, _SplitWriter],
                     val_fraction: float, progress: bool) -> None:
    """Encode each batch of documents and append each document to its split's writer."""
    from tqdm.auto import tqdm

    held, threshold, start = None, val_fraction * 2**32, time.perf_counter()
    with tqdm(unit=" docs", desc="tokenize", disable=not progress) as bar:
        for batch in batches:
            for (name, _), ids in zip(batch, encode([t for _, t in batch]), strict=True):
                if zlib.crc32(name.encode()) < threshold:
                    writers["val"].append(ids)
                else:  # one document held back: val's if no name hashes into val
                    if held is not None:
                        writers["train"].append(held)
                    held = ids
            bar.update(len(batch))
            tokens = writers["train"].tokens + writers["val"].tokens
            bar.set_postfix_str(f"{tokens:,} tokens, "
                                f"{tokens / (time.perf_counter() - start):,.0f} tokens/s")
    if held is not None:
        writers["train" if writers["val"].starts.count else "val"].append(held)


# ---------------------------------------------------------------------------------------------
# Reading


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
    process_count = _data._check_int("process_count", process_count, 1)
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

    def batch_starts(self, step: int, batch_size: int, seq_len: int, *, seed: int) -> np.ndarray:
        """int64 [batch_size]: the window starts of training batch `step`, drawn exactly as
        `TokenStream.batch` draws them."""
        step, seed = _data._check_int("step", step, 0), _data._check_int("seed", seed, 0)
        batch_size = _data._check_int("batch_size", batch_size, 1)
        width = _data._check_int("seq_len", seq_len, 1) + 1
        rng = np.random.default_rng([seed, step])
        return rng.integers(0, max(len(self) - width, 0) + 1, batch_size)

    def batch(self, step: int, batch_size: int, seq_len: int, *, seed: int,
              rows: tuple[int, int] | None = None) -> np.ndarray:
        """Training batch `step`: int32 [batch_size, seq_len + 1], equal to `TokenStream.batch`
        on the same tokens. With `rows=(start, stop)`, only those rows, int32
        [stop - start, seq_len + 1], and only their windows are read: each process of a
        multi-process run reads its own (`tfx.parallel.process_row_range`, `even_row_range`)."""
        starts = self.batch_starts(step, batch_size, seq_len, seed=seed)
        if rows is not None:
            if not 0 <= rows[0] <= rows[1] <= batch_size:
                raise ValueError(f"rows must be (start, stop) with 0 <= start <= stop <= "
                                 f"batch_size ({batch_size}), got {rows}")
            starts = starts[rows[0]:rows[1]]
        return self.windows(starts, seq_len + 1)

    # The evenly spaced validation windows: TokenStream's own function (it only calls len and
    # windows), so validation batches match too.
    eval_batches = TokenStream.eval_batches
