"""Packing whole documents into fixed-length training rows (numpy only, no jax).

A row holds several documents side by side, each its own segment: the models take the segment
ids (attention never crosses a document) and per-document positions, so a document in a packed
row is computed exactly as if it were alone, while rows carry almost no padding.

    packed = pack([doc_a, doc_b, doc_c], row_len=129)
    packed.tokens, packed.segment_ids, packed.positions     # each [num_rows, 129]
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

__all__ = ["Packed", "lay_out", "pack"]


@dataclasses.dataclass(frozen=True, eq=False)
class Packed:
    """Rows of packed documents, all [num_rows, row_len].

    Attributes:
      tokens: the documents' tokens (their common integer dtype); padding is `pad_id`.
      segment_ids: 1, 2, 3 ... for the documents of a row, left to right; 0 on padding. The
        smallest unsigned dtype that holds row_len.
      positions: 0, 1, ... within each document (piece); 0 on padding. Same dtype.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    @property
    def efficiency(self) -> float:
        """Share of the row tokens that are document tokens (not padding)."""
        return float((self.segment_ids > 0).mean()) if self.segment_ids.size else 0.0


def pack(documents: Sequence[np.ndarray], row_len: int, *, pad_id: int = 0) -> Packed:
    """Pack whole documents into rows of `row_len` tokens, by best-fit decreasing.

    A document longer than a row is first cut into row-length pieces (and a shorter last
    piece); each piece is its own segment and starts at position 0, so no attention or position
    spans two pieces. Full-length pieces fill rows of their own; the other pieces go, longest
    first (ties: in document order), into the open row with the least room that still fits
    them (ties: the row opened first), or a new row. Best-fit decreasing is deterministic and
    uses at most 11/9 of the fewest rows possible (plus one): the packing of Ding et al. 2024,
    "Fewer Truncations Improve Language Modeling". Within a row, documents keep their input
    order. Empty documents add nothing.

    Args:
      documents: a non-empty sequence of 1-D integer arrays (token ids).
      row_len: tokens per row, >= 1.
      pad_id: the token of padding positions.
    Returns:
      `Packed` with [num_rows, row_len] arrays.
    Raises:
      TypeError: naming `row_len` or `documents[i]` for a non-integer row length or array.
      ValueError: naming `row_len` (< 1) or `documents` (empty, not 1-D, or no tokens at all).
    """
    if isinstance(row_len, bool) or not isinstance(row_len, int | np.integer):
        raise TypeError(f"row_len must be an int, got {row_len!r}")
    if row_len < 1:
        raise ValueError(f"row_len must be >= 1, got {row_len}")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int | np.integer) or pad_id < 0:
        raise TypeError(f"pad_id must be an int >= 0, got {pad_id!r}")
    docs = _checked_documents(documents)
    lengths = np.array([len(d) for d in docs], np.int64)
    if not lengths.sum():
        raise ValueError("documents hold no tokens")
    flat = np.concatenate(docs)
    starts, piece_lengths = _pieces(lengths, int(row_len))
    rows = _best_fit_decreasing(piece_lengths, int(row_len))
    return _layout(flat, starts, piece_lengths, rows, int(row_len), pad_id)


def lay_out(documents: Sequence[np.ndarray], rows: np.ndarray, row_len: int, *,
            pad_id: int = 0) -> Packed:
    """Write documents into the rows chosen for them (by a packing of the caller's own, e.g. of
    source and target sides together): in each row, its documents in input order, as segments
    1, 2, ... with positions from 0.

    Args:
      documents: D 1-D integer arrays.
      rows: int [D], the row of each document: rows 0 .. max(rows) each get at least one,
        and the documents of a row hold at most row_len tokens in all.
    Returns:
      `Packed` with [max(rows) + 1, row_len] arrays.
    Raises:
      ValueError: naming `documents` (one is empty) or `rows` (a row too full or unused).
    """
    docs = _checked_documents(documents)
    lengths = np.array([len(d) for d in docs], np.int64)
    rows = np.asarray(rows, np.int64)
    if lengths.min() < 1:
        raise ValueError("documents must not be empty here: each is a segment")
    load = np.bincount(rows, lengths) if rows.shape == lengths.shape else np.zeros(0)
    if not load.size or load.max() > row_len or not np.all(np.bincount(rows)):
        raise ValueError(f"rows must give each of the {len(docs)} documents a row, use every "
                         f"row and fit {row_len} tokens in each, got loads {load.tolist()}")
    return _layout(np.concatenate(docs), np.cumsum(lengths) - lengths, lengths, rows, row_len,
                   pad_id)


def _checked_documents(documents) -> list[np.ndarray]:
    if isinstance(documents, np.ndarray) or not isinstance(documents, Sequence):
        raise TypeError(f"documents must be a sequence of 1-D integer arrays, got "
                        f"{type(documents).__name__}")
    if not documents:
        raise ValueError("documents must not be empty")
    docs = []
    for i, document in enumerate(documents):
        array = np.asarray(document)
        if array.ndim != 1:
            raise ValueError(f"documents[{i}] must be 1-D, got shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer) and array.size:
            raise TypeError(f"documents[{i}] must hold integers, got dtype {array.dtype}")
        docs.append(array if array.size else array.astype(np.int32))
    return docs


def _pieces(lengths: np.ndarray, row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Document lengths [D] -> (start in the concatenation, length) of every row-sized piece,
    in document order: int64 [P] each."""
    counts = -(-lengths // row_len)
    doc = np.repeat(np.arange(len(lengths)), counts)
    first = np.cumsum(counts) - counts
    doc_start = np.cumsum(lengths) - lengths
    starts = doc_start[doc] + (np.arange(len(doc)) - first[doc]) * row_len
    return starts, np.minimum(row_len, doc_start[doc] + lengths[doc] - starts)


def _best_fit_decreasing(lengths: np.ndarray, row_len: int) -> np.ndarray:
    """Piece lengths [P] (each 1..row_len) -> the row of each piece, int64 [P]. Rows are
    numbered in the order they open."""
    rows = np.empty(len(lengths), np.int64)
    full = lengths == row_len
    rows[full] = np.arange(full.sum())  # a full piece is a row: no search needed
    num_rows = int(full.sum())
    # Open rows by free room: open_rows[room] is a heap of the rows with that much room left,
    # so that among equally good rows the earliest opened is taken.
    open_rows: list[list[int]] = [[] for _ in range(row_len + 1)]
    has_room = np.zeros(row_len + 1, bool)
    rest = np.flatnonzero(~full)
    for piece in rest[np.argsort(-lengths[rest], kind="stable")]:
        length = int(lengths[piece])
        room = length + int(has_room[length:].argmax())
        if not has_room[room]:  # no open row fits: open one
            row, room = num_rows, row_len
            num_rows += 1
        else:
            row = heapq.heappop(open_rows[room])
            has_room[room] = bool(open_rows[room])
        rows[piece] = row
        if room > length:
            heapq.heappush(open_rows[room - length], row)
            has_room[room - length] = True
    return rows


def _layout(flat, starts, lengths, rows, row_len: int, pad_id: int) -> Packed:
    """Write each piece (tokens flat[start : start + length]) into its row, after the pieces
    of that row that come before it in document order."""
    order = np.lexsort((np.arange(len(rows)), rows))  # by row, then document order
    rows, starts, lengths = rows[order], starts[order], lengths[order]
    row_first = np.r_[True, rows[1:] != rows[:-1]]
    group_start = np.maximum.accumulate(np.where(row_first, np.arange(len(rows)), 0))
    ends = np.cumsum(lengths)
    columns = ends - lengths - (ends - lengths)[group_start]  # where each piece starts
    segments = np.arange(len(rows)) - group_start + 1
    piece = np.repeat(np.arange(len(rows)), lengths)
    within = np.arange(len(piece)) - (ends - lengths)[piece]  # position in the piece
    num_rows = int(rows[-1]) + 1
    index = np.s_[rows[piece], columns[piece] + within]
    small = np.min_scalar_type(row_len)
    tokens = np.full((num_rows, row_len), pad_id,
                     np.promote_types(flat.dtype, np.min_scalar_type(pad_id)))
    tokens[index] = flat[starts[piece] + within]
    segment_ids = np.zeros((num_rows, row_len), small)
    segment_ids[index] = segments[piece]
    positions = np.zeros((num_rows, row_len), small)
    positions[index] = within
    return Packed(tokens, segment_ids, positions)
