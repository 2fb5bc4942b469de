"""data.packing: the packed feeds (tfx.train.packed_feed) and losses (tfx.train.packed_losses).
Batches are a function of (seed, step); targets never cross a document and padding never
counts; the packed causal loss of a row is the sum of its documents' losses alone."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_cases import CORPUS, tiny, write_corpus

from tfx.models import create
from tfx.train import losses, packed_losses
from tfx.train.data import ByteTokenizer
from tfx.train.objectives import get_objective
from tfx.train.packed_feed import (
    PackedMaskedFeed,
    PackedTaskFeed,
    PackedTextFeed,
    load_documents,
)
from tfx.train.packing import pack

FEEDS = {"gpt_char": PackedTextFeed, "bert_mlm": PackedMaskedFeed,
         "seq2seq_reverse": PackedTaskFeed}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def packed(name, data=None):
    e = tiny(name, data)
    return dataclasses.replace(e, data=dataclasses.replace(e.data, packing=True))


@pytest.mark.parametrize("name", list(FEEDS))
def test_batches_depend_only_on_seed_and_step(name, corpus):
    experiment = packed(name, corpus)
    objective = get_objective(experiment.objective)
    feed = objective.batches(experiment)
    assert type(feed) is FEEDS[name]
    again = objective.batches(experiment)
    chex.assert_trees_all_equal(feed.train(3), again.train(3))
    chex.assert_trees_all_equal(feed.validation(), again.validation())
    assert any(np.any(a != b) for a, b in zip(feed.train(3).values(), feed.train(4).values(),
                                              strict=True))
    batch = feed.train(0)
    assert all(v.dtype == np.int32 and len(v) == experiment.train.batch_size
               for v in batch.values())
    assert len(feed.validation()) == experiment.train.eval_batches


def test_a_single_file_packs_its_lines_and_a_folder_its_files(corpus, tmp_path):
    train, val = load_documents(str(corpus), ByteTokenizer(), val_fraction=0.1)
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    assert [bytes(d.astype(np.uint8)).decode() for d in train + val] == lines
    (tmp_path / "a.py").write_text("alpha\nbeta\n")
    (tmp_path / "b.py").write_text("gamma\n")
    train, val = load_documents(str(tmp_path), ByteTokenizer(), val_fraction=0.5)
    assert sorted(bytes(d.astype(np.uint8)).decode() for d in train + val) == [
        "alpha\nbeta\n", "gamma\n"]


def test_causal_weights_stop_at_document_boundaries_and_padding():
    documents = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 22)]
    rows = pack(documents, 12)
    batch = {"tokens": rows.tokens, "segment_ids": rows.segment_ids.astype(np.int32),
             "positions": rows.positions.astype(np.int32)}

    def model(ids, **kwargs):  # uniform logits: every target costs log(vocab)
        return jnp.zeros((*ids.shape, 30))

    total, count, _ = packed_losses.packed_causal_lm(model, batch, jax.random.key(0))
    assert count == sum(len(d) - 1 for d in documents)  # 4 + 2 + 1 targets
    np.testing.assert_allclose(total, count * np.log(30), rtol=1e-6)


def test_packed_causal_loss_is_the_sum_of_the_documents_alone():
    model = create("char-gpt", rngs=nnx.Rngs(0), num_layers=1, d_model=32, num_heads=2,
                   d_ff=64, attention={"num_kv_heads": None})
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 256, n) for n in (9, 6, 12, 4)]
    rows = pack(documents, 17)
    batch = {"tokens": rows.tokens, "segment_ids": rows.segment_ids.astype(np.int32),
             "positions": rows.positions.astype(np.int32)}
    total, count, _ = packed_losses.packed_causal_lm(model, batch, jax.random.key(0))
    alone = [losses.causal_lm(model, {"tokens": d[None]}, jax.random.key(0))
             for d in documents]
    np.testing.assert_allclose(total, sum(a[0] for a in alone), rtol=1e-5)
    assert count == sum(a[1] for a in alone)


def test_masked_rows_are_cls_text_sep_segments(corpus):
    feed = get_objective("mlm").batches(packed("bert_mlm", corpus))
    batch, tokenizer = feed.train(0), feed.tokenizer
    cls, sep, pad = (tokenizer.token_id(n) for n in ("[CLS]", "[SEP]", "[PAD]"))
    ids, segments, positions = batch["input_ids"], batch["segment_ids"], batch["positions"]
    starts = (positions == 0) & (segments > 0)
    np.testing.assert_array_equal(ids[starts], cls)
    ends = (segments > 0) & (np.pad(segments, ((0, 0), (0, 1)))[:, 1:] != segments)
    np.testing.assert_array_equal(ids[ends], sep)
    np.testing.assert_array_equal(ids[segments == 0], pad)


def test_seq2seq_segments_pair_each_source_with_its_answer():
    feed = get_objective("seq2seq").batches(packed("seq2seq_reverse"))
    batch, task = feed.train(0), feed.task
    for row in range(len(batch["input_ids"])):
        count = batch["segment_ids"][row].max()
        assert count == batch["decoder_segment_ids"][row].max() >= 1
        for k in range(1, count + 1):
            source = task.tokenizer.decode(batch["input_ids"][row][batch["segment_ids"][row] == k])
            labels = batch["labels"][row][batch["decoder_segment_ids"][row] == k]
            assert task.decode_target(labels) == task.answer(source)
            assert labels[-1] == task.eos_id


def test_exact_match_counts_examples_not_rows():
    segments = jnp.array([[1, 1, 2, 2, 2, 3, 0], [1, 1, 1, 1, 0, 0, 0]])
    wrong = jnp.array([[0, 0, 0, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0]], bool)
    # Row 0: examples 1 and 3 right, 2 wrong (the wrong padding is no example); row 1: right.
    assert packed_losses._exact_examples(wrong, segments) == {"exact": 3.0, "sequences": 4.0}
