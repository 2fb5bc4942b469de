"""Tests for tfx.train.shards and tfx.train.shard_writer: token shards written once and read as
memory-mapped streams that draw exactly TokenStream's batches."""

import json
import mmap
import os
import tracemalloc
import zlib

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from tfx.train.data import ByteTokenizer, HFTokenizer, TokenStream, load_corpus, mlm_batch
from tfx.train.packed_feed import load_documents
from tfx.train.shard_writer import tokenize_to_shards
from tfx.train.shards import ShardStream, even_row_range, is_shard_folder, open_shards

# Small shards, so that many windows cross a shard boundary (some cross several).
SHARD_TOKENS = 97
TEXTS = [(f"doc{i:02d}.txt", f"document {i}: " + "ünïcödé ✓ line\n" * (i % 7 + 1)
          + "the quick brown fox " * i) for i in range(40)]


def reference_split(texts, val_fraction):
    """The split rule written out: a text goes to val when the crc32 of its name is below
    val_fraction of 2**32; when none does, the last training text goes to val instead."""
    is_val = [zlib.crc32(name.encode()) < val_fraction * 2**32 for name, _ in texts]
    train = [t for t, v in zip(texts, is_val, strict=True) if not v]
    val = [t for t, v in zip(texts, is_val, strict=True) if v]
    return (train, val) if val else (train[:-1], train[-1:])


def make_bpe(folder, words):
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel
                                  .alphabet())
    tokenizer.train_from_iterator([words] * 20, trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return HFTokenizer(folder)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return make_bpe(tmp_path_factory.mktemp("tok") / "bpe", "the quick brown fox document")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for name, text in TEXTS:
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def byte_shards(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("byte_shards")
    tokenize_to_shards([corpus], ByteTokenizer(), out, shard_tokens=SHARD_TOKENS, progress=False)
    return out


def starts_of(texts, tokenizer):
    lengths = [len(tokenizer.encode(t)) for _, t in texts]
    return np.cumsum([0] + [n + len(tokenizer.encode("\n\n")) for n in lengths[:-1]])


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_batches_equal_token_stream_on_the_same_texts(kind, corpus, bpe, tmp_path):
    tokenizer = ByteTokenizer() if kind == "byte" else bpe
    manifest = tokenize_to_shards([corpus], tokenizer, tmp_path, val_fraction=0.1,
                                  shard_tokens=SHARD_TOKENS, progress=False)
    assert manifest.dtype == ("uint8" if kind == "byte" else "uint16")
    for split, texts in zip(("train", "val"), reference_split(TEXTS, 0.1), strict=True):
        stream, ref = open_shards(tmp_path, tokenizer, split), TokenStream.from_texts(
            texts, tokenizer)
        assert len(stream) == len(ref) and len(stream.shards) == -(-len(ref) // SHARD_TOKENS)
        np.testing.assert_array_equal(stream.windows([0], len(ref))[0], ref.tokens)
        np.testing.assert_array_equal(stream.document_starts, starts_of(texts, tokenizer))
        for seed in (0, 7):
            for step in range(4):
                np.testing.assert_array_equal(stream.batch(step, 8, 16, seed=seed),
                                              ref.batch(step, 8, 16, seed=seed))
        for got, want in zip(stream.eval_batches(3, 4, 10), ref.eval_batches(3, 4, 10),
                             strict=True):
            np.testing.assert_array_equal(got, want)
        ids = {"cls_id": 1, "sep_id": 2, "pad_id": 0}
        for key, value in mlm_batch(stream, 5, 4, 12, seed=1, **ids).items():
            np.testing.assert_array_equal(value, mlm_batch(ref, 5, 4, 12, seed=1, **ids)[key])


def test_every_window_across_shard_boundaries(byte_shards):
    stream = open_shards(byte_shards, ByteTokenizer())
    tokens = stream.windows([0], len(stream))[0]
    for width in (1, SHARD_TOKENS, 3 * SHARD_TOKENS + 5):  # up to windows over five shards
        starts = np.arange(len(stream) - width + 1)
        np.testing.assert_array_equal(stream.windows(starts, width),
                                      tokens[starts[:, None] + np.arange(width)])
    with pytest.raises(ValueError, match="starts must be in"):
        stream.windows([len(stream) - 3], 4)
    with pytest.raises(ValueError, match="seq_len"):
        stream.batch(0, 2, len(stream), seed=0)


def test_jsonl_and_parquet_rows_are_documents(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [text for _, text in TEXTS[:25]]
    rows[3] = "  \n"  # blank rows are left out but keep their row number
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "rows.jsonl", "w") as out:
        out.writelines(json.dumps({"id": i, "content": text}) + "\n" for i, text in
                       enumerate(rows))
    pq.write_table(pa.table({"content": rows}), tmp_path / "src" / "rows.parquet",
                   row_group_size=7)
    with pytest.warns(UserWarning, match="skipped 2 documents"):
        tokenize_to_shards([tmp_path / "src"], ByteTokenizer(), tmp_path / "out",
                           text_field="content", shard_tokens=SHARD_TOKENS, progress=False)
    texts = [(f"rows.{kind}:{i}", text) for kind in ("jsonl", "parquet")
             for i, text in enumerate(rows) if text.strip()]
    for split, part in zip(("train", "val"), reference_split(texts, 0.05), strict=True):
        stream = open_shards(tmp_path / "out", ByteTokenizer(), split)
        np.testing.assert_array_equal(stream.windows([0], len(stream))[0],
                                      TokenStream.from_texts(part, ByteTokenizer()).tokens)
    with pytest.raises(ValueError, match="not a JSON object with a string field 'text'"):
        tokenize_to_shards([tmp_path / "src" / "rows.jsonl"], ByteTokenizer(), tmp_path / "b")
    with pytest.raises(ValueError, match="no column 'text'"):
        tokenize_to_shards([tmp_path / "src" / "rows.parquet"], ByteTokenizer(), tmp_path / "b")


def test_a_corpus_that_hashes_nothing_into_val_gives_it_its_last_document(tmp_path):
    (tmp_path / "in").mkdir()
    for name, text in TEXTS[:3]:
        (tmp_path / "in" / name).write_text(text)
    manifest = tokenize_to_shards([tmp_path / "in"], ByteTokenizer(), tmp_path / "out",
                                  val_fraction=1e-9, progress=False)
    assert (manifest.splits["train"]["documents"], manifest.splits["val"]["documents"]) == (2, 1)
    val = open_shards(tmp_path / "out", ByteTokenizer(), "val")
    assert ByteTokenizer().decode(val.windows([0], len(val))[0]) == TEXTS[2][1]


def test_process_shares_read_only_their_rows_and_make_the_global_batch(byte_shards):
    stream = open_shards(byte_shards, ByteTokenizer())
    read = []
    windows = stream.windows
    stream.windows = lambda starts, width: read.append(np.asarray(starts)) or windows(starts,
                                                                                      width)
    whole = stream.batch(3, 8, 16, seed=5)
    starts = stream.batch_starts(3, 8, 16, seed=5)
    read.clear()
    parts = [stream.batch(3, 8, 16, seed=5, rows=even_row_range(8, p, 4)) for p in range(4)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert len(read) == 4
    for p, got in enumerate(read):  # each process asked for the windows of its 2 rows only
        np.testing.assert_array_equal(got, starts[2 * p:2 * p + 2])
    with pytest.raises(ValueError, match="multiple of process_count"):
        even_row_range(6, 0, 4)
    with pytest.raises(ValueError, match="rows must be"):
        stream.batch(0, 8, 16, seed=0, rows=(4, 9))


def test_a_batch_reads_windows_not_shards(byte_shards, tmp_path):
    # A 64 GiB shard (sparse: it takes no disk) that no process could read whole.
    for name in os.listdir(byte_shards):
        (tmp_path / name).write_bytes((byte_shards / name).read_bytes())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    huge = 2**36
    os.truncate(tmp_path / "train-00001.bin", huge)
    train["tokens"] += huge - train["shards"][1]["count"]
    train["shards"][1]["count"] = huge
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    stream = open_shards(tmp_path, ByteTokenizer())
    assert len(stream) > huge and all(isinstance(s.base.obj, mmap.mmap) for s in stream.shards)
    tracemalloc.start()
    for step in range(10):
        stream.batch(step, 64, 1024, seed=0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 2**20  # a batch is 64 × 1025 int32 = 256 KiB; a shard 64 GiB
    np.testing.assert_array_equal(stream.windows([0], 50), open_shards(
        byte_shards, ByteTokenizer()).windows([0], 50))


def test_damaged_missing_and_foreign_shards_are_refused(byte_shards, corpus, bpe, tmp_path):
    for name in os.listdir(byte_shards):
        (tmp_path / name).write_bytes((byte_shards / name).read_bytes())
    byte = ByteTokenizer()
    shard = tmp_path / "train-00002.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1])
    with pytest.raises(ValueError, match=r"train-00002.bin' is damaged: 96 bytes.*re-run"):
        open_shards(tmp_path, byte)
    shard.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, other bytes
    open_shards(tmp_path, byte)  # sizes only, by default
    with pytest.raises(ValueError, match=r"sha256 differs.*re-run"):
        open_shards(tmp_path, byte, verify=True)
    (tmp_path / "val-00000.bin").unlink()
    with pytest.raises(ValueError, match=r"val-00000.bin' is missing.*re-run"):
        open_shards(tmp_path, byte, "val")
    with pytest.raises(ValueError, match=r"made with tokenizer 'byte' \(byte\), not '.*"
                                         r"tokenizer.json' \(sha256:.*re-run"):
        open_shards(tmp_path, bpe)
    tokenize_to_shards([corpus], bpe, tmp_path / "bpe_shards", progress=False)
    other = make_bpe(tmp_path / "other_bpe", "a different vocabulary entirely")
    with pytest.raises(ValueError, match=f"made with tokenizer '{bpe.path}'.*other_bpe"):
        open_shards(tmp_path / "bpe_shards", other)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(ValueError, match=r"format version 99.*re-run"):
        open_shards(tmp_path, byte)
    with pytest.raises(ValueError, match="split must be"):
        open_shards(byte_shards, byte, "test")


def test_an_unfinished_or_absent_shard_set_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text\n" * 200)
    # Past the first batch of documents, so shards are written before the bad row is read.
    (tmp_path / "src" / "b.jsonl").write_text('{"text": "fine"}\n' * 2000 + "not json\n")
    with pytest.raises(ValueError, match="line 2001 is not a JSON object"):
        tokenize_to_shards([tmp_path / "src"], ByteTokenizer(), tmp_path / "out",
                           progress=False)
    assert (tmp_path / "out" / "train-00000.bin").is_file()  # written before the failure
    assert is_shard_folder(tmp_path / "out") and not is_shard_folder(tmp_path / "src")
    for folder in (tmp_path / "out", tmp_path / "src"):
        with pytest.raises(ValueError, match=r"no manifest.json.*re-run"):
            open_shards(folder, ByteTokenizer())
    with pytest.raises(ValueError, match="holds files that are not token shards"):
        tokenize_to_shards([tmp_path / "src" / "a.txt"], ByteTokenizer(), tmp_path / "src")
    with pytest.raises(ValueError, match="lies inside source"):
        tokenize_to_shards([tmp_path / "src"], ByteTokenizer(), tmp_path / "src" / "shards")
    with pytest.raises(ValueError, match="does not exist"):
        tokenize_to_shards([tmp_path / "nope"], ByteTokenizer(), tmp_path / "out")
    with pytest.raises(ValueError, match="at least two"):
        tokenize_to_shards([tmp_path / "src" / "a.txt"], ByteTokenizer(), tmp_path / "out")


def test_load_corpus_reads_a_shard_folder(byte_shards):
    train, val = load_corpus(byte_shards, ByteTokenizer())
    assert isinstance(train, ShardStream) and (train.split, val.split) == ("train", "val")
    with pytest.warns(UserWarning, match="val_fraction=0.2 is not used"):
        load_corpus(byte_shards, ByteTokenizer(), val_fraction=0.2)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_packing_reads_the_documents_of_a_shard_folder_not_its_files(kind, corpus, bpe,
                                                                      tmp_path):
    # data.packing on shards: each document as it was encoded, without the separator ids that
    # joined it to the next (small shards: documents cross shard boundaries), split as tokenized.
    tokenizer = ByteTokenizer() if kind == "byte" else bpe
    tokenize_to_shards([corpus], tokenizer, tmp_path, val_fraction=0.1,
                       shard_tokens=SHARD_TOKENS, progress=False)
    documents = load_documents(str(tmp_path), tokenizer, val_fraction=0.1)
    for got, texts in zip(documents, reference_split(TEXTS, 0.1), strict=True):
        assert len(got) == len(texts)
        for doc, (_, text) in zip(got, texts, strict=True):
            np.testing.assert_array_equal(doc, tokenizer.encode(text))
