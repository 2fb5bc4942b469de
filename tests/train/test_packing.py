"""tfx.train.packing.pack against a written-out reference: every document's tokens appear once,
in order, with positions 0..n-1 in segments of their own; padding is segment 0."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.train.packing import pack


def _reference_pieces(documents, row_len):
    """Each document cut into row_len pieces, written out: [(doc index, tokens)]."""
    return [(i, list(doc[start:start + row_len]))
            for i, doc in enumerate(documents) for start in range(0, len(doc), row_len)]


def _segments_of(packed):
    """The packed rows read back: [(row, segment id, tokens, positions)] in row order."""
    found = []
    for row in range(packed.tokens.shape[0]):
        for segment in range(1, int(packed.segment_ids[row].max()) + 1):
            where = np.flatnonzero(packed.segment_ids[row] == segment)
            assert where.size, f"row {row} skips segment {segment}"
            assert np.all(np.diff(where) == 1), f"row {row}: segment {segment} is not contiguous"
            found.append((row, segment, list(packed.tokens[row, where]),
                          list(packed.positions[row, where])))
    return found


documents_strategy = st.lists(st.integers(0, 40), min_size=1, max_size=30).filter(any)


@settings(max_examples=200, deadline=None)
@given(lengths=documents_strategy, row_len=st.integers(1, 24))
def test_every_document_once_in_order_with_its_positions(lengths, row_len):
    rng = np.random.default_rng(sum(lengths))
    documents = [rng.integers(1, 1000, n) for n in lengths]
    packed = pack(documents, row_len)
    assert packed.tokens.shape == packed.segment_ids.shape == packed.positions.shape
    assert packed.tokens.shape[1] == row_len
    expected = sorted((tuple(tokens) for _, tokens in _reference_pieces(documents, row_len)))
    segments = _segments_of(packed)
    assert sorted(tuple(tokens) for _, _, tokens, _ in segments) == expected
    for _, _, tokens, positions in segments:
        assert positions == list(range(len(tokens)))
    padding = packed.segment_ids == 0
    assert np.all(packed.tokens[padding] == 0) and np.all(packed.positions[padding] == 0)
    assert int((~padding).sum()) == sum(lengths)
    # Segments are left-aligned: padding only after a row's last segment.
    assert np.all(np.diff(padding.astype(int), axis=1) >= 0)


@settings(max_examples=100, deadline=None)
@given(lengths=documents_strategy, row_len=st.integers(1, 24))
def test_rows_keep_document_order_and_best_fit_bound(lengths, row_len):
    documents = [np.full(n, i + 1) for i, n in enumerate(lengths)]  # token = document number
    packed = pack(documents, row_len)
    for row in range(packed.tokens.shape[0]):
        docs = [packed.tokens[row, packed.segment_ids[row] == s][0]
                for s in range(1, int(packed.segment_ids[row].max()) + 1)]
        assert docs == sorted(docs), "a row's documents keep their input order"
    pieces = [len(t) for _, t in _reference_pieces(documents, row_len)]
    fewest = -(-sum(pieces) // row_len)  # a lower bound on the rows any packing needs
    assert packed.tokens.shape[0] <= 11 / 9 * fewest + 1


def test_small_example_written_out():
    packed = pack([np.array([1, 2, 3]), np.array([4, 5, 6, 7, 8, 9, 10]), np.array([11])], 4,
                  pad_id=99)
    # Pieces: [1 2 3], [4 5 6 7] (full: its own row, first), [8 9 10], [11].
    # Best fit, longest first: [1 2 3] opens row 1, [8 9 10] opens row 2, [11] fills row 1.
    np.testing.assert_array_equal(packed.tokens, [[4, 5, 6, 7], [1, 2, 3, 11],
                                                  [8, 9, 10, 99]])
    np.testing.assert_array_equal(packed.segment_ids, [[1, 1, 1, 1], [1, 1, 1, 2],
                                                       [1, 1, 1, 0]])
    np.testing.assert_array_equal(packed.positions, [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 0]])
    assert packed.efficiency == 11 / 12


def test_deterministic_and_keeps_token_dtype():
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 256, n).astype(np.uint8) for n in rng.integers(1, 300, 200)]
    a, b = pack(documents, 64), pack(list(documents), 64)
    for name in ("tokens", "segment_ids", "positions"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.tokens.dtype == np.uint8
    assert pack(documents, 64, pad_id=256).tokens.dtype == np.uint16


@pytest.mark.parametrize("documents, row_len, error, match", [
    ([np.arange(3)], 0, ValueError, "row_len"),
    ([np.arange(3)], 2.0, TypeError, "row_len"),
    ([], 4, ValueError, "documents"),
    ([np.arange(3), np.ones(2)], 4, TypeError, r"documents\[1\]"),
    ([np.ones((2, 2), int)], 4, ValueError, r"documents\[0\]"),
    ([np.zeros(0, int)], 4, ValueError, "no tokens"),
    (np.arange(4), 4, TypeError, "documents"),
])
def test_bad_input_names_the_argument(documents, row_len, error, match):
    with pytest.raises(error, match=match):
        pack(documents, row_len)
