"""The training loop: outputs, resumption that ends where an uninterrupted run ends, and bad
input that leaves the workdir alone."""

from __future__ import annotations

import dataclasses
import json
import shutil

import chex
import numpy as np
import pytest
from train_cases import tiny, write_corpus

from tfx.train.loop import Trainer, train
from tfx.train.metrics import read_metrics


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _final_params(workdir, experiment):
    trainer = Trainer(experiment, workdir)
    step = trainer.restore()
    params = trainer.state.params
    trainer.close()
    return step, params


def test_a_run_writes_metrics_tensorboard_checkpoints_and_a_plot(tmp_path, corpus):
    experiment = tiny("gpt_char", corpus)
    result = train(experiment, tmp_path, progress=False)
    assert result.step == 6 and not result.interrupted
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["split"] == "train"] == [2, 4, 6]
    assert [r["step"] for r in records if r["split"] == "val"] == [3, 6]
    assert all(np.isfinite(r["loss"]) for r in records)
    assert {"loss", "grad_norm", "accuracy", "tokens_per_s", "mfu"} <= records[0].keys()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                  if p.name.isdigit()) == [3, 6]
    assert result.validation["loss"] == records[-1]["loss"]


def test_resuming_ends_where_an_uninterrupted_run_ends(tmp_path, corpus):
    experiment = tiny("gpt_char", corpus)  # with dropout: its masks must repeat too
    experiment = dataclasses.replace(experiment, model=experiment.model.replace(dropout=0.1))
    train(experiment, tmp_path / "whole", progress=False)
    # An interrupted run: the same run killed after its step-3 checkpoint.
    train(experiment, tmp_path / "cut", progress=False)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "6")
    train(experiment, tmp_path / "cut", progress=False)
    whole_step, whole = _final_params(tmp_path / "whole", experiment)
    cut_step, cut = _final_params(tmp_path / "cut", experiment)
    assert whole_step == cut_step == 6
    chex.assert_trees_all_equal(whole, cut)
    metrics = [read_metrics(tmp_path / d / "metrics.jsonl") for d in ("whole", "cut")]
    assert [r["step"] for r in metrics[0]] == [r["step"] for r in metrics[1]]
    for a, b in zip(*metrics, strict=True):
        assert a["loss"] == b["loss"]


def test_another_config_in_the_same_workdir_is_refused_untouched(tmp_path, corpus):
    experiment = tiny("gpt_char", corpus, steps=3)
    train(experiment, tmp_path, progress=False)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    wider = dataclasses.replace(experiment, model=experiment.model.replace(d_model=64))
    with pytest.raises(ValueError, match="d_model: 32 vs 64"):
        train(wider, tmp_path, progress=False)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_an_unreadable_data_path_fails_before_anything_is_written(tmp_path):
    experiment = tiny("gpt_char", tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="data"):
        train(experiment, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["bert_mlm", "seq2seq_reverse"])
def test_other_objectives_train(tmp_path, corpus, name):
    experiment = tiny(name, corpus, steps=4, eval_every=4, checkpoint_every=4)
    result = train(experiment, tmp_path, progress=False)
    assert result.step == 4 and np.isfinite(result.validation["loss"])
    assert 0.0 <= result.validation["accuracy"] <= 1.0
    if name == "seq2seq_reverse":
        assert "exact_match" in result.validation
    stored = json.loads((tmp_path / "checkpoints" / "config.json").read_text())
    assert stored["objective"] == experiment.objective


def test_a_mixture_of_experts_trains_and_logs_its_routing_losses(tmp_path, corpus):
    experiment = tiny("moe_gpt", corpus, steps=4, eval_every=4, checkpoint_every=4)
    experiment = dataclasses.replace(experiment, model=experiment.model.replace(
        router_jitter=0.1, capacity_factor=1.0))
    result = train(experiment, tmp_path, progress=False)
    assert result.step == 4 and np.isfinite(result.validation["loss"])
    train_records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert all(1.0 <= r["load_balancing_loss"] <= 8.0 for r in train_records)
    assert all(r["router_z_loss"] > 0 for r in train_records)
