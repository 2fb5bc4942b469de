"""The training configs' `Literal` choices (tfx.train.config, tfx.train.finetuning) are the
names in tfx.names, and those are the keys of the tables that give them their behaviour: the
configs import without jax, some tables with it, and these tests keep them the same (as
tests/models/test_config_literals.py does for the model configs)."""

from __future__ import annotations

import typing

import pytest

from tfx import names
from tfx.train import config, finetuning, objectives, preference, tasks


def _choices(cls: type, field: str) -> tuple:
    """The names a config field's Literal allows (None, where it is optional, left out)."""
    hint = typing.get_type_hints(cls)[field]
    literals = [arg for arg in typing.get_args(hint) if typing.get_origin(arg) is typing.Literal]
    return typing.get_args(literals[0] if literals else hint)


@pytest.mark.parametrize("cls,field,table", [
    (config.Experiment, "objective", names.OBJECTIVES),
    (config.DataConfig, "task", names.TASKS),
    (config.PreferenceConfig, "loss", names.PREFERENCE_LOSSES),
    (config.TrainConfig, "nonfinite", names.NONFINITE_ACTIONS),
    (finetuning.LoraTuning, "quantize", names.QUANT_TYPES),
])
def test_each_literal_is_its_names_tuple(cls, field, table):
    assert _choices(cls, field) == table


def test_the_tables_are_keyed_by_the_names():
    assert tuple(objectives.OBJECTIVES) == names.OBJECTIVES
    assert tasks.TASKS == names.TASKS
    assert preference.LOSS_TYPES == names.PREFERENCE_LOSSES


def test_the_quantization_tables_are_keyed_by_the_names():
    quantize = pytest.importorskip("tfx.quant.quantize")  # qwix is an optional extra
    assert tuple(quantize.QTYPES) == names.QUANT_TYPES
    assert tuple(quantize.BLOCK_SIZES) == names.QUANT_TYPES
