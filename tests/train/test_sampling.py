"""The prompt of `tfx train`'s closing sample (tfx.train.sampling.closing_prompt): from the data
(the first line of the first validation text, the first prompt of a JSONL file) or
train.sample_prompt, never a fixed "def "."""

from __future__ import annotations

import dataclasses
import json

import pytest
from train_cases import tiny

from tfx.train.config import TrainConfig, run_identity
from tfx.train.data import ByteTokenizer, corpus_texts, split_texts
from tfx.train.sampling import closing_prompt, validation_opening
from tfx.train.shard_writer import tokenize_to_shards

TEXTS = {"a.txt": "Alpha text.\n", "b.txt": "\n\nThe first line of b is here\nand more\n",
         "c.txt": "Gamma text.\n", "d.txt": "Delta.\n"}


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "texts"
    root.mkdir()
    for name, text in TEXTS.items():
        (root / name).write_text(text)
    return root


def _with_train(experiment, **changes):
    return dataclasses.replace(experiment, train=dataclasses.replace(experiment.train,
                                                                     **changes))


def test_a_text_run_is_prompted_with_the_first_line_of_its_first_validation_text(folder):
    experiment = tiny("gpt_char", folder)
    _, validation = split_texts(corpus_texts(str(folder)), experiment.data.val_fraction)
    first = validation[0][1]
    line = next(line for line in first.splitlines(keepends=True) if line.strip())
    assert closing_prompt(experiment) == (line, False)
    assert line != "def "


def test_a_long_first_line_is_cut_after_a_word(folder):
    for name in TEXTS:  # whichever text is the validation one
        (folder / name).write_text("word " * 30 + "\nsecond line\n")
    assert validation_opening(tiny("gpt_char", folder), max_chars=12) == "word word "


def test_token_shards_give_the_opening_of_the_same_validation_text(folder, tmp_path):
    shards = tmp_path / "shards"
    experiment = tiny("gpt_char", folder)
    tokenize_to_shards([str(folder)], ByteTokenizer(), shards,
                       val_fraction=experiment.data.val_fraction, progress=False)
    from_shards = dataclasses.replace(experiment, data=dataclasses.replace(
        experiment.data, source=str(shards)))
    assert validation_opening(from_shards) == validation_opening(experiment)


@pytest.mark.parametrize("record,expected", [
    ({"prompt": "Say hi.", "completion": "Hi."}, ("Say hi.", False)),
    ({"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Say hi."},
                   {"role": "assistant", "content": "Hi."}]}, ("Say hi.", True))])
def test_a_jsonl_run_is_prompted_with_its_first_prompt_and_a_set_prompt_keeps_its_form(
        tmp_path, record, expected):
    path = tmp_path / "data.jsonl"
    path.write_text("\n" + json.dumps(record) + "\n")
    experiment = tiny("sft", path)
    assert closing_prompt(experiment) == expected
    assert closing_prompt(_with_train(experiment, sample_prompt="Count.")) == (
        "Count.", expected[1])


def test_the_sample_prompt_is_a_loop_setting_checked_for_its_type(folder):
    experiment = tiny("gpt_char", folder)
    prompted = _with_train(experiment, sample_prompt="class ")
    assert closing_prompt(prompted) == ("class ", False)
    assert run_identity(prompted) == run_identity(experiment)  # a resumed run may change it
    with pytest.raises(TypeError, match=r"train\.sample_prompt must be a str or None, got 3"):
        TrainConfig(sample_prompt=3)
