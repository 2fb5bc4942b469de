"""Tests for tfx.train.tasks: synthetic copy / reverse / sort / addition batches."""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.train.tasks import TASKS, SyntheticTask

PAD, BOS, EOS = 256, 257, 258


def rows(task, batch):
    """(source text, label text) per row, decoded independently of the task's own helpers."""
    out = []
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["label_mask"],
                                 strict=True):
        source = bytes(ids[ids < 256].astype(np.uint8)).decode("ascii")
        answer = bytes(labels[mask][:-1].astype(np.uint8)).decode("ascii")
        out.append((source, answer))
    return out


def reference(name, source):
    """The tasks written out independently of SyntheticTask.answer."""
    if name.startswith("addition"):
        a, b = source.split("+")
        total = str(int(a) + int(b))
        return total[::-1] if name == "addition_reversed" else total
    return {"copy": source, "reverse": source[::-1], "sort": "".join(sorted(source))}[name]


@pytest.mark.parametrize("name", TASKS)
def test_labels_are_the_answer_to_the_source(name):
    task = SyntheticTask(name)
    batch = task.batch(0, 256, seed=0)
    for source, answer in rows(task, batch):
        assert answer == reference(name, source) == task.answer(source)


@pytest.mark.parametrize("name", TASKS)
def test_shapes_and_dtypes_are_fixed(name):
    task = SyntheticTask(name, min_len=3, max_len=9)
    source_len = 10 if name.startswith("addition") else 9
    assert (task.source_len, task.target_len) == (source_len, 10)
    for step in range(5):
        batch = task.batch(step, 8, seed=step)
        assert set(batch) == {"input_ids", "attention_mask", "decoder_input_ids", "labels",
                              "label_mask"}
        for key in ("input_ids", "attention_mask"):
            assert batch[key].shape == (8, source_len)
        for key in ("decoder_input_ids", "labels", "label_mask"):
            assert batch[key].shape == (8, 10)
        for key in ("input_ids", "decoder_input_ids", "labels"):
            assert batch[key].dtype == np.int32
        assert batch["attention_mask"].dtype == batch["label_mask"].dtype == bool


@pytest.mark.parametrize("name", TASKS)
def test_padding_bos_and_eos_layout(name):
    task = SyntheticTask(name)
    batch = task.batch(1, 64, seed=0)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    np.testing.assert_array_equal(mask, ids != PAD)
    assert (np.diff(mask.astype(int), axis=1) <= 0).all()  # no gaps: source then padding
    labels, label_mask, decoder = batch["labels"], batch["label_mask"], batch["decoder_input_ids"]
    lengths = label_mask.sum(1) - 1  # answer length, without EOS
    for row in range(64):
        n = lengths[row]
        assert decoder[row, 0] == BOS and labels[row, n] == EOS
        np.testing.assert_array_equal(decoder[row, 1 : n + 1], labels[row, :n])  # teacher forcing
        assert (labels[row, n + 1 :] == PAD).all() and (decoder[row, n + 1 :] == PAD).all()
        assert label_mask[row, : n + 1].all() and not label_mask[row, n + 1 :].any()
        assert not np.isin(labels[row, :n], [PAD, BOS, EOS]).any()


@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
def test_letter_sources_span_the_length_range(name):
    task = SyntheticTask(name, min_len=2, max_len=7)
    sources = [source for source, _ in rows(task, task.batch(0, 512, seed=0))]
    assert {len(s) for s in sources} == set(range(2, 8))
    assert all(re.fullmatch("[a-z]+", s) for s in sources)
    assert len(set("".join(sources))) == 26


def test_addition_operands():
    task = SyntheticTask("addition", min_len=3, max_len=8)
    sources = [source for source, _ in rows(task, task.batch(0, 1024, seed=0))]
    digits = {len(s) - 1 for s in sources}
    assert digits == set(range(3, 9))
    operands = [number for source in sources for number in source.split("+")]
    assert all(n == "0" or not n.startswith("0") for n in operands)  # no leading zeros
    assert "0" in operands  # a one-digit operand may be 0
    assert {len(source.split("+")[0]) for source in sources} == set(range(1, 8))


def test_addition_at_the_int64_limit_is_exact():
    task = SyntheticTask("addition", min_len=18, max_len=18)
    batch = task.batch(0, 256, seed=0)
    answers = [answer for _, answer in rows(task, batch)]
    for source, answer in rows(task, batch):
        assert answer == reference("addition", source)
    # 17-digit operands occur; a 17-digit + 1-digit sum can carry to 18 = target_len - 1 digits.
    assert 17 <= max(len(a) for a in answers) <= task.target_len - 1 == 18


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(TASKS), min_len=st.integers(2, 10), extra=st.integers(0, 8),
       step=st.integers(0, 10**6), seed=st.integers(0, 2**32 - 1))
def test_any_configuration_gives_correct_fixed_shape_batches(name, min_len, extra, step, seed):
    task = SyntheticTask(name, min_len=min_len, max_len=min_len + extra)
    batch = task.batch(step, 16, seed=seed)
    assert batch["input_ids"].shape == (16, task.source_len)
    assert batch["labels"].shape == (16, task.target_len)
    for source, answer in rows(task, batch):
        assert answer == reference(name, source)


@pytest.mark.parametrize("name", TASKS)
def test_batches_are_deterministic(name):
    task = SyntheticTask(name)
    first = task.batch(3, 16, seed=7)
    task.batch(4, 16, seed=7)
    again = task.batch(3, 16, seed=7)
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    assert not np.array_equal(task.batch(4, 16, seed=7)["input_ids"], first["input_ids"])
    assert not np.array_equal(task.batch(3, 16, seed=8)["input_ids"], first["input_ids"])


def test_decode_target_stops_at_eos():
    task = SyntheticTask("copy")
    assert task.decode_target([104, 105, EOS, 106, PAD]) == "hi"
    assert task.decode_target(np.array([104, 105, PAD])) == "hi"
    batch = task.batch(0, 4, seed=0)
    for labels, ids in zip(batch["labels"], batch["input_ids"], strict=True):
        assert task.decode_target(labels) == task.tokenizer.decode(ids)


def test_tokenizer_and_special_ids():
    task = SyntheticTask("sort")
    assert task.tokenizer.vocab_size == 259
    assert (task.pad_id, task.bos_id, task.eos_id) == (PAD, BOS, EOS)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": "multiply"}, ValueError, "name"),
        ({"name": "copy", "min_len": 0}, ValueError, "min_len"),
        ({"name": "copy", "min_len": 5, "max_len": 4}, ValueError, "max_len"),
        ({"name": "addition", "min_len": 1}, ValueError, "min_len"),
        ({"name": "addition", "max_len": 19}, ValueError, "max_len"),
        ({"name": "copy", "max_len": 8.0}, TypeError, "max_len"),
    ],
)
def test_bad_configurations(kwargs, error, match):
    with pytest.raises(error, match=match):
        SyntheticTask(**kwargs)


def test_bad_batch_arguments_and_answer_input():
    task = SyntheticTask("addition")
    with pytest.raises(ValueError, match="batch_size"):
        task.batch(0, 0, seed=0)
    with pytest.raises(ValueError, match="step"):
        task.batch(-1, 2, seed=0)
    with pytest.raises(ValueError, match="source_text"):
        task.answer("12-3")


def test_reversed_addition_writes_the_sum_least_significant_digit_first():
    plain, backwards = SyntheticTask("addition"), SyntheticTask("addition_reversed")
    assert backwards.answer("95+7") == "201"
    first, second = plain.batch(2, 64, seed=3), backwards.batch(2, 64, seed=3)
    np.testing.assert_array_equal(first["input_ids"], second["input_ids"])  # same sums
    np.testing.assert_array_equal(first["label_mask"], second["label_mask"])
    for (_, answer), (_, reversed_answer) in zip(rows(plain, first), rows(backwards, second),
                                                 strict=True):
        assert reversed_answer == answer[::-1]
