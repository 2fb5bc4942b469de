"""Tests for tfx.train.data: tokenizers, the stdlib corpus, text folders, splits and batches."""

import pathlib
import random
import sysconfig
import zlib

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from tfx.train.config import DataConfig
from tfx.train.data import (
    STDLIB_MAX_BYTES,
    ByteTokenizer,
    HFTokenizer,
    TokenStream,
    load_corpus,
    load_tokenizer,
    mlm_batch,
    split_texts,
    stdlib_texts,
    text_files,
)

BERT_SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")


@pytest.fixture(scope="module")
def stdlib():
    return stdlib_texts()


@pytest.fixture(scope="module")
def stdlib_streams():
    return load_corpus(None, ByteTokenizer(), val_fraction=0.05)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "a.txt").write_text("alpha line one\nalpha line two\n")
    (tmp_path / "sub" / "b.md").write_text("# bravo\n\nünïcödé text ✓\n")
    (tmp_path / "c.py").write_text("print('charlie')\n")
    (tmp_path / "model.bin").write_bytes(bytes(range(256)))  # has a NUL byte
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / ".git" / "config").write_text("[core]\n")
    return tmp_path


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(BERT_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


# --- ByteTokenizer -----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tokenizer = ByteTokenizer(BERT_SPECIALS)
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, list(text.encode("utf-8")))
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_specials_follow_the_bytes():
    tokenizer = ByteTokenizer(BERT_SPECIALS)
    assert tokenizer.vocab_size == 260
    assert [tokenizer.token_id(name) for name in BERT_SPECIALS] == [256, 257, 258, 259]
    assert ByteTokenizer().vocab_size == 256
    # The text "[PAD]" is five bytes, never the special id.
    np.testing.assert_array_equal(tokenizer.encode("[PAD]"), list(b"[PAD]"))


def test_byte_tokenizer_decode_skips_specials_and_replaces_bad_utf8():
    tokenizer = ByteTokenizer(("[BOS]",))
    assert tokenizer.decode([256, 104, 105, 256]) == "hi"
    assert tokenizer.decode(np.array([[104], [105]])) == "hi"
    assert tokenizer.decode([0xE9, 104]) == "\ufffdh"
    assert tokenizer.decode([]) == ""


def test_byte_tokenizer_errors():
    tokenizer = ByteTokenizer(("[BOS]",))
    with pytest.raises(ValueError, match=r"\[EOS\]"):
        tokenizer.token_id("[EOS]")
    with pytest.raises(ValueError, match="ids must be in"):
        tokenizer.decode([257])
    with pytest.raises(ValueError, match="ids must be in"):
        tokenizer.decode([-1])
    with pytest.raises(TypeError, match="ids"):
        tokenizer.decode([1.5])
    with pytest.raises(TypeError, match="text"):
        tokenizer.encode(b"bytes")
    with pytest.raises(ValueError, match="distinct"):
        ByteTokenizer(("[A]", "[A]"))
    with pytest.raises(TypeError, match="specials"):
        ByteTokenizer(["[A]"])


# --- HFTokenizer and load_tokenizer ------------------------------------------------------------


def test_hf_tokenizer_round_trip_from_folder_and_file(hf_tokenizer_dir):
    for path in (hf_tokenizer_dir, hf_tokenizer_dir / "tokenizer.json", str(hf_tokenizer_dir)):
        tokenizer = HFTokenizer(path)
        text = "the lazy fox, quickly! 123"
        ids = tokenizer.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert ids.max() < tokenizer.vocab_size
        assert tokenizer.decode(ids) == text
        assert tokenizer.vocab_size <= 400


def test_hf_tokenizer_special_tokens(hf_tokenizer_dir):
    tokenizer = load_tokenizer(hf_tokenizer_dir, specials=BERT_SPECIALS)
    ids = [tokenizer.token_id(name) for name in BERT_SPECIALS]
    assert ids == [0, 1, 2, 3]  # trained with them first
    text_ids = tokenizer.encode("the dog")
    assert not set(text_ids.tolist()) & set(ids)  # encode adds no specials
    assert tokenizer.decode([ids[1], *text_ids, ids[2]]) == "the dog"
    with pytest.raises(ValueError, match=r"\[BOS\]"):
        tokenizer.token_id("[BOS]")
    with pytest.raises(ValueError, match=r"\[BOS\]"):
        load_tokenizer(hf_tokenizer_dir, specials=("[BOS]",))


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer file"):
        HFTokenizer(tmp_path)  # a folder without tokenizer.json
    with pytest.raises(ValueError, match="no tokenizer file"):
        HFTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ not json")
    with pytest.raises(ValueError, match="not a readable"):
        HFTokenizer(tmp_path)
    with pytest.raises(TypeError, match="tokenizer"):
        load_tokenizer(3)


def test_load_tokenizer_byte():
    assert load_tokenizer("byte") == ByteTokenizer()
    assert load_tokenizer("byte", specials=["[PAD]"]) == ByteTokenizer(("[PAD]",))


# --- texts -------------------------------------------------------------------------------------


def test_stdlib_texts_are_sorted_library_modules(stdlib):
    paths = [rel for rel, _ in stdlib]
    assert paths == sorted(paths)
    assert len(set(paths)) == len(paths)
    assert all(rel.endswith(".py") for rel in paths)
    assert "collections/__init__.py" in paths and "abc.py" in paths
    for rel in paths:
        parts = rel.split("/")
        assert not {"site-packages", "test", "tests", "idlelib", "encodings"} & set(parts), rel
    total = sum(len(text.encode("utf-8")) for _, text in stdlib)
    assert 2 * 2**20 < total <= STDLIB_MAX_BYTES
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    assert stdlib[0][1] == (root / stdlib[0][0]).read_text("utf-8")


def test_stdlib_texts_cap_is_a_prefix(stdlib):
    small = stdlib_texts(max_bytes=200_000)
    assert 0 < len(small) < len(stdlib)
    assert small == stdlib[: len(small)]
    assert sum(len(text.encode("utf-8")) for _, text in small) <= 200_000


def test_text_files_reads_a_folder(folder):
    texts = text_files(folder)
    assert [rel for rel, _ in texts] == ["a.txt", "c.py", "sub/b.md"]
    assert dict(texts)["sub/b.md"] == "# bravo\n\nünïcödé text ✓\n"


def test_text_files_reads_one_file(folder):
    assert text_files(folder / "c.py") == [("c.py", "print('charlie')\n")]
    assert text_files(str(folder / "a.txt"))[0][0] == "a.txt"


def test_text_files_errors(tmp_path, folder):
    with pytest.raises(ValueError, match=r"data: .* does not exist"):
        text_files(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"data: .* no UTF-8 text"):
        text_files(folder / "model.bin")
    empty = tmp_path / "binaries"
    empty.mkdir()
    (empty / "x.bin").write_bytes(b"\0\1\2")
    with pytest.raises(ValueError, match=r"data: .* no UTF-8 text"):
        text_files(empty)


def test_split_is_disjoint_complete_and_order_independent(stdlib):
    train, val = split_texts(stdlib, 0.05)
    assert len(val) == round(0.05 * len(stdlib))
    train_paths, val_paths = {r for r, _ in train}, {r for r, _ in val}
    assert not train_paths & val_paths
    assert train_paths | val_paths == {r for r, _ in stdlib}
    assert [r for r, _ in train] == sorted(train_paths)  # input order kept
    shuffled = list(stdlib)
    random.Random(0).shuffle(shuffled)
    assert {r for r, _ in split_texts(shuffled, 0.05)[1]} == val_paths


def test_split_takes_the_smallest_crc32(folder):
    texts = text_files(folder)
    _, val = split_texts(texts, 0.3)
    assert [r for r, _ in val] == [min((r for r, _ in texts), key=lambda r: zlib.crc32(r.encode()))]


def test_split_of_a_lone_text_cuts_at_a_line_break():
    text = "".join(f"line {i}\n" for i in range(100))
    (_, train), = split_texts([("only.txt", text)], 0.1)[0]
    (_, val), = split_texts([("only.txt", text)], 0.1)[1]
    assert train + val == text
    assert train.endswith("\n") and val.startswith("line ")
    assert 0.08 < len(val) / len(text) < 0.12


@pytest.mark.parametrize("val_fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_rejects_fractions_outside_the_open_interval(val_fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        split_texts([("a", "x"), ("b", "y")], val_fraction)


def test_split_errors_when_a_side_would_be_empty():
    with pytest.raises(ValueError, match="val_fraction"):
        split_texts([("a", "x"), ("b", "y")], 0.9)
    with pytest.raises(ValueError, match="val_fraction"):
        split_texts([("a", "x")], 0.5)  # one character cannot be cut in two
    with pytest.raises(ValueError, match="texts"):
        split_texts([], 0.5)


# --- TokenStream -------------------------------------------------------------------------------


def test_token_stream_joins_texts_with_a_blank_line():
    stream = TokenStream.from_texts([("a", "ab"), ("b", "cd")], ByteTokenizer())
    assert stream.tokens.dtype == np.uint8
    assert bytes(stream.tokens) == b"ab\n\ncd"
    assert TokenStream.from_texts([("a", "ab")], ByteTokenizer(BERT_SPECIALS)).tokens.dtype == (
        np.uint16)


def test_batch_windows_are_consecutive_tokens():
    stream = TokenStream(np.arange(1000, dtype=np.int32))
    batch = stream.batch(7, batch_size=32, seq_len=16, seed=3)
    assert batch.shape == (32, 17) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, batch[:, :1] + np.arange(17))
    assert batch.min() >= 0 and batch.max() < 1000


def test_batch_depends_only_on_seed_and_step(stdlib_streams):
    train, _ = stdlib_streams
    first = train.batch(5, 8, 64, seed=1)
    for step in (0, 1, 2):  # other steps in between do not disturb step 5
        train.batch(step, 8, 64, seed=1)
    np.testing.assert_array_equal(train.batch(5, 8, 64, seed=1), first)
    assert not np.array_equal(train.batch(6, 8, 64, seed=1), first)
    assert not np.array_equal(train.batch(5, 8, 64, seed=2), first)


def test_batch_covers_the_whole_stream():
    stream = TokenStream(np.arange(20, dtype=np.int32))
    starts = np.concatenate([stream.batch(s, 16, 4, seed=0)[:, 0] for s in range(20)])
    assert set(starts.tolist()) == set(range(16))  # every start 0..len-(seq_len+1)


def test_eval_batches_are_evenly_spaced_and_span_the_stream():
    stream = TokenStream(np.arange(1001, dtype=np.int32))
    batches = stream.eval_batches(num_batches=3, batch_size=4, seq_len=10)
    assert len(batches) == 3 and all(b.shape == (4, 11) for b in batches)
    starts = np.concatenate([b[:, 0] for b in batches])
    assert starts[0] == 0 and batches[-1][-1, -1] == 1000
    np.testing.assert_allclose(np.diff(starts), 990 / 11, atol=1)
    for got, again in zip(batches, stream.eval_batches(3, 4, 10), strict=True):
        np.testing.assert_array_equal(got, again)


def test_stdlib_streams_are_the_split_texts_joined(stdlib, stdlib_streams):
    train, val = stdlib_streams
    train_texts, val_texts = split_texts(stdlib, 0.05)
    assert bytes(val.tokens) == "\n\n".join(text for _, text in val_texts).encode("utf-8")
    assert len(train) == sum(len(t.encode("utf-8")) + 2 for _, t in train_texts) - 2


def test_stream_errors():
    stream = TokenStream(np.arange(10, dtype=np.int32))
    with pytest.raises(ValueError, match="seq_len"):
        stream.batch(0, 2, seq_len=10, seed=0)  # needs 11 tokens
    with pytest.raises(ValueError, match="seq_len"):
        stream.eval_batches(1, 2, seq_len=10)
    with pytest.raises(ValueError, match="step"):
        stream.batch(-1, 2, 4, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        stream.batch(0, 0, 4, seed=0)
    with pytest.raises(TypeError, match="seed"):
        stream.batch(0, 2, 4, seed=1.0)
    with pytest.raises(TypeError, match="step"):
        stream.batch(True, 2, 4, seed=0)
    with pytest.raises(TypeError, match="tokens"):
        TokenStream(np.zeros((2, 2), np.int32))


# --- load_corpus -------------------------------------------------------------------------------


def test_load_corpus_from_a_folder(folder):
    train, val = load_corpus(folder, ByteTokenizer(), val_fraction=0.3)
    tokens = {bytes(train.tokens), bytes(val.tokens)}
    texts = dict(text_files(folder))
    assert sum(len(t) for t in tokens) == sum(len(t.encode()) for t in texts.values()) + 2
    assert any(t == texts["c.py"].encode() for t in tokens)  # the val side is one whole file


def test_load_corpus_stdlib_name_and_errors(tmp_path):
    train, _ = load_corpus("stdlib", ByteTokenizer(), val_fraction=0.5)
    assert len(train) > 1000
    with pytest.raises(ValueError, match="data"):
        load_corpus(tmp_path / "missing", ByteTokenizer(), val_fraction=0.05)


# --- mlm_batch ---------------------------------------------------------------------------------


def mlm(stream, step=0, batch_size=256, seq_len=12, seed=0):
    return mlm_batch(stream, step, batch_size, seq_len, seed=seed, cls_id=1000, sep_id=1001,
                     pad_id=1002)


def test_mlm_rows_are_cls_text_sep_pad():
    stream = TokenStream(np.arange(500, dtype=np.int32))
    batch = mlm(stream)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape == (256, 12)
    assert ids.dtype == np.int32 and mask.dtype == bool
    np.testing.assert_array_equal(ids[:, 0], 1000)
    lengths = (ids < 500).sum(1)
    assert lengths.min() == 6 and lengths.max() == 10  # seq_len // 2 .. seq_len - 2, both reached
    for row, length in zip(ids, lengths, strict=True):
        np.testing.assert_array_equal(row[1 : length + 1], row[1] + np.arange(length))
        assert row[length + 1] == 1001
        assert (row[length + 2 :] == 1002).all()
    np.testing.assert_array_equal(mask, ids != 1002)


def test_mlm_batch_is_deterministic(stdlib_streams):
    train, _ = stdlib_streams
    first = mlm(train, step=3, batch_size=4, seq_len=64)
    np.testing.assert_array_equal(mlm(train, step=3, batch_size=4, seq_len=64)["input_ids"],
                                  first["input_ids"])
    assert not np.array_equal(mlm(train, step=4, batch_size=4, seq_len=64)["input_ids"],
                              first["input_ids"])


def test_mlm_batch_errors():
    stream = TokenStream(np.arange(5, dtype=np.int32))
    with pytest.raises(ValueError, match="seq_len"):
        mlm(stream, seq_len=3)
    with pytest.raises(ValueError, match="seq_len"):
        mlm(stream, seq_len=8)  # needs 6 text tokens, the stream has 5
    with pytest.raises(ValueError, match="pad_id"):
        mlm_batch(stream, 0, 1, 4, seed=0, cls_id=1, sep_id=2, pad_id=-1)


def test_a_folder_reports_the_files_it_skips(folder):
    with pytest.warns(UserWarning, match=r"data: skipped 3 of 6 files in .*: 1 binary "
                                         r"\(e\.g\. 'model\.bin'\), 1 blank \(e\.g\. "
                                         r"'empty\.txt'\), 1 not UTF-8 \(e\.g\. 'latin1\.txt'\)"):
        texts = text_files(folder)
    assert len(texts) == 3


def test_a_folder_without_text_says_what_it_skipped(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0\1\2")
    with pytest.raises(ValueError, match=r"no UTF-8 text \(1 binary \(e\.g\. 'x\.bin'\)\)"):
        text_files(tmp_path)


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_data_path_is_refused(path):
    # pathlib reads "" as ".": training read the current directory.
    with pytest.raises(ValueError, match="data: the path must not be empty"):
        text_files(path)
    with pytest.raises(ValueError, match=r"data\.source must not be an empty path"):
        DataConfig(source=path)
    with pytest.raises(ValueError, match="tokenizer must be 'byte' or a path"):
        load_tokenizer(path)
