"""Writing token shards: `tokenize_to_shards` streams documents (text files, JSONL rows,
Parquet rows) through a tokenizer into a shard folder, never holding the corpus.

The folder's layout, the manifest and the split rule are `tfx.train.shards`'s (it reads them
back as `ShardStream`s); this module only writes them: documents are read and encoded in
batches (all cores), appended to their split's shard files, and the manifest goes last.
"""

from __future__ import annotations

import collections
import hashlib
import json
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
from tfx.train.shards import (
    MANIFEST,
    SEPARATOR,
    SPLITS,
    VERSION,
    Manifest,
    shard_dtype,
    tokenizer_identity,
)
from tfx.train.tokens import ByteTokenizer, Text, _check_int

__all__ = ["tokenize_to_shards"]

DEFAULT_SHARD_TOKENS = 2**27  # 256 MiB of uint16: few files, each far larger than a batch
_BATCH_DOCS, _BATCH_CHARS = 1024, 16 * 2**20  # per encode_batch call: bounded memory, all cores
_OWN_FILES = re.compile(r"(train|val)-(\d{5,}|docs)\.bin|manifest\.json(\.tmp)?")


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
    """Tokenize `sources` once into the shard folder `out_dir` (layout: `tfx.train.shards`).

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
    shard_tokens = _check_int("shard_tokens", shard_tokens, 1)
    identity, name = tokenizer_identity(tokenizer)
    vocab = tokenizer.vocab_size
    dtype = shard_dtype(vocab)
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

