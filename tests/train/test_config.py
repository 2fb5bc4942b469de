"""Experiment configs: validation, the stored form, and the registry."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tfx.ops.positional import ProportionalScaling, YaRNScaling
from tfx.train.config import (
    DataConfig,
    Experiment,
    MeshConfig,
    TrainConfig,
    experiment_from_dict,
    run_identity,
)
from tfx.train.experiments import EXPERIMENTS, get_experiment


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_stored_form_round_trips(name):
    experiment = EXPERIMENTS[name]
    assert experiment_from_dict(json.loads(json.dumps(experiment.to_dict()))) == experiment


@pytest.mark.parametrize("scaling", [
    YaRNScaling(factor=4.0, original_max_position_embeddings=256),
    ProportionalScaling(fraction=0.25, factor=2.0),  # Gemma 4's, defined beside the others
], ids=lambda scaling: type(scaling).__name__)
def test_rope_scaling_objects_round_trip(scaling):
    e = get_experiment("gpt_char")
    scaled = dataclasses.replace(e, model=e.model.replace(rope={"scaling": scaling}))
    assert experiment_from_dict(json.loads(json.dumps(scaled.to_dict()))) == scaled


def test_loop_settings_are_not_part_of_a_runs_identity():
    e = get_experiment("gpt_char")
    chattier = dataclasses.replace(e, train=dataclasses.replace(e.train, log_every=1,
                                                                checkpoint_every=7))
    longer = dataclasses.replace(e, train=dataclasses.replace(e.train, steps=e.train.steps + 1))
    assert run_identity(chattier) == run_identity(e)
    assert run_identity(longer) != run_identity(e)  # the schedule depends on steps


def test_moe_training_settings_are_validated_in_the_training_config():
    for name in ("load_balancing_weight", "router_z_weight", "router_bias_rate"):
        with pytest.raises(ValueError, match=rf"train\.{name} must be >= 0"):
            TrainConfig(**{name: -0.1})


def test_every_position_has_an_equal_footing_experiment():
    names = [n for n in EXPERIMENTS if n.startswith("posenc_")]
    assert {EXPERIMENTS[n].model.position for n in names} == {
        "learned", "sinusoidal", "rope", "alibi", "t5", "xl", "none"}
    # The same model but for the encoding (and the embedding scale sinusoids come with).
    reference = EXPERIMENTS[names[0]].model.replace(position="rope")
    for n in names:
        model = EXPERIMENTS[n].model
        assert model.embeddings.scale == (model.position == "sinusoidal")
        assert model.replace(position="rope", embeddings={"scale": False}) == reference
        assert EXPERIMENTS[n].train == EXPERIMENTS[names[0]].train


@pytest.mark.parametrize("changes,match", [
    (dict(steps=0), "steps"), (dict(batch_size=6, grad_accum=4), "grad_accum"),
    (dict(log_every=0), "log_every")])
def test_bad_train_settings(changes, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**changes)


def test_experiment_checks_model_family_and_task():
    e = get_experiment("gpt_char")
    with pytest.raises(TypeError, match="EncoderConfig"):
        dataclasses.replace(e, objective="mlm")
    with pytest.raises(ValueError, match=r"data\.task"):
        dataclasses.replace(get_experiment("seq2seq_reverse"), data=DataConfig())
    learned = e.model.replace(position="learned", max_len=64)
    with pytest.raises(ValueError, match="seq_len"):
        dataclasses.replace(e, model=learned)
    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        get_experiment("nope")
    assert isinstance(get_experiment(), Experiment)


def test_context_parallel_runs_are_refused_before_any_work_when_they_cannot_split():
    e = get_experiment("gpt_char")
    split = dataclasses.replace(e, mesh=MeshConfig(data=2, sequence=4))
    assert split.mesh.sequence == 4  # causal self-attention, RoPE, 128 tokens = 8 chunks
    with pytest.raises(ValueError, match=r"mesh\.sequence=4 \(context parallelism\) needs "
                                         r"self-attention without a position bias.*'alibi'"):
        dataclasses.replace(split, model=e.model.replace(position="alibi"))
    with pytest.raises(ValueError, match=r"objective 'seq2seq'"):
        dataclasses.replace(get_experiment("seq2seq_reverse"), mesh=MeshConfig(sequence=2))
    with pytest.raises(ValueError, match=r"train\.seq_len divisible by 8 \(2 chunks per "
                                         r"device\), got 100"):
        dataclasses.replace(split, train=dataclasses.replace(e.train, seq_len=100))
    with pytest.raises(ValueError, match=r"sequence must be >= 1, got 0"):
        MeshConfig(sequence=0)
