"""tfx.train.objectives: one object per objective, registered once by name, importable without
jax; each bundles its model family, tokenizer, batches and loss."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing

import pytest
from train_cases import tiny, write_corpus

from tfx.models.config import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from tfx.train import losses
from tfx.train.config import Experiment, experiment_from_dict
from tfx.train.feed import MaskedFeed, TaskFeed, TextFeed
from tfx.train.objectives import OBJECTIVES, get_objective

KINDS = {"causal_lm": ("gpt_char", DecoderConfig, TextFeed, True),
         "mlm": ("bert_mlm", EncoderConfig, MaskedFeed, False),
         "seq2seq": ("seq2seq_reverse", EncoderDecoderConfig, TaskFeed, False)}
# Objectives of JSONL files and a transformers tokenizer folder: their feeds and losses are
# tested on a Hugging Face folder (tests/train/test_hf_finetune.py, test_preference.py).
FOLDER_KINDS = {"sft", "dpo"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_the_registry_holds_the_names_an_experiment_accepts():
    names = typing.get_args(typing.get_type_hints(Experiment)["objective"])
    assert set(names) == set(OBJECTIVES) == set(KINDS) | FOLDER_KINDS
    assert all(objective.name == name for name, objective in OBJECTIVES.items())
    assert all(dataclasses.is_dataclass(o) and type(o).__dataclass_params__.frozen
               for o in OBJECTIVES.values())
    with pytest.raises(ValueError, match=r"objective must be one of \('causal_lm', 'mlm', "
                                         r"'seq2seq', 'sft', 'dpo'\), got 'gpt'"):
        get_objective("gpt")


@pytest.mark.parametrize("name", list(KINDS))
def test_each_objective_bundles_its_family_tokenizer_batches_and_loss(name, corpus):
    experiment_name, family, feed_class, can_sample = KINDS[name]
    experiment = tiny(experiment_name, corpus)
    objective = get_objective(experiment.objective)
    assert objective is OBJECTIVES[name]
    assert objective.model_config is family and objective.can_sample is can_sample
    feed = objective.batches(experiment)
    assert type(feed) is feed_class
    assert feed.tokenizer.vocab_size == objective.tokenizer(experiment).vocab_size
    batch = feed.train(0)
    assert all(len(v) == experiment.train.batch_size for v in batch.values())
    assert len(feed.validation()) == experiment.train.eval_batches


def test_the_losses_carry_the_experiments_settings():
    mlm = dataclasses.replace(tiny("bert_mlm"), mlm_probability=0.3)
    loss = get_objective("mlm").loss(mlm)
    assert loss.func is losses.masked_lm and loss.keywords == {"mlm_probability": 0.3}
    seq = dataclasses.replace(tiny("seq2seq_reverse"), label_smoothing=0.1)
    loss = get_objective("seq2seq").loss(seq)
    assert loss.func is losses.sequence_to_sequence
    assert loss.keywords == {"label_smoothing": 0.1}
    assert get_objective("causal_lm").loss(tiny("gpt_char")) is losses.causal_lm


def test_an_experiment_is_checked_by_its_objective():
    e = tiny("gpt_char")
    with pytest.raises(TypeError, match="objective 'mlm' needs model: EncoderConfig, got "
                                        "DecoderConfig"):
        dataclasses.replace(e, objective="mlm")
    with pytest.raises(ValueError, match="objective must be one of"):
        dataclasses.replace(e, objective="gpt")
    seq = tiny("seq2seq_reverse")
    with pytest.raises(ValueError, match=r"objective 'seq2seq' needs data.task"):
        dataclasses.replace(seq, data=dataclasses.replace(seq.data, task=None))


def test_a_stored_objective_name_loads_as_its_object():
    stored = json.loads(json.dumps(tiny("bert_mlm").to_dict()))
    assert stored["objective"] == "mlm"
    assert get_objective(experiment_from_dict(stored).objective) is OBJECTIVES["mlm"]


def test_the_objectives_and_the_old_loss_names_import_without_jax():
    code = ("import sys; import tfx.train.objectives as o; "
            "assert 'jax' not in sys.modules, 'jax imported'; "
            "assert o.get_objective('causal_lm').model_config.__name__ == 'DecoderConfig'; "
            "from tfx.train.objectives import causal_lm; "
            "from tfx.train.losses import causal_lm as loss; assert causal_lm is loss")
    subprocess.run([sys.executable, "-c", code], check=True)

