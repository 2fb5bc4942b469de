"""The training loop: outputs, resumption that ends where an uninterrupted run ends, and bad
input that leaves the workdir alone."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import warnings
from types import SimpleNamespace

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from train_cases import tiny, write_corpus

from tfx.train import loop
from tfx.train.feed import TextFeed
from tfx.train.flops import nominal_peak_flops
from tfx.train.loop import Trainer, train
from tfx.train.metrics import MetricsWriter, read_metrics


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
    assert result.step == 6 and result.signal is None and not result.interrupted
    assert result.artifacts == {"checkpoints": tmp_path / "checkpoints",
                                "metrics": tmp_path / "metrics.jsonl",
                                "loss_plot": tmp_path / "loss.png",
                                "tensorboard": tmp_path / "tensorboard"}
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["split"] == "train"] == [2, 4, 6]
    assert [r["step"] for r in records if r["split"] == "val"] == [3, 6]
    assert all(np.isfinite(r["loss"]) for r in records)
    # MFU against the measured matmul peak; against a nominal peak only where one is known.
    assert {"loss", "grad_norm", "accuracy", "tokens_per_s", "mfu_measured"} <= records[0].keys()
    assert ("mfu" in records[0]) == (nominal_peak_flops(jax.devices()[0].device_kind) is not None)
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
    with pytest.raises(ValueError, match="d_model: 32 -> 64") as refused:
        train(wider, tmp_path, progress=False)
    # Another model cannot start from this run's weights: only a new workdir will do.
    assert "new --workdir" in str(refused.value) and "--init-from" not in str(refused.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_more_steps_on_a_finished_run_are_refused_with_how_to_continue(tmp_path, corpus):
    experiment = tiny("gpt_char", corpus, steps=3)
    train(experiment, tmp_path / "run", progress=False)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    longer = dataclasses.replace(experiment, train=dataclasses.replace(experiment.train, steps=6))
    with pytest.raises(ValueError, match=r"differing fields \(stored -> this run\): "
                                         r"train\.steps: 3 -> 6\.") as refused:
        train(longer, tmp_path / "run", progress=False)
    message = str(refused.value)
    assert f"--workdir NEW_WORKDIR --init-from {tmp_path / 'run'}" in message
    assert "not extended in place" in message
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # The way it names: a new run that starts from the finished one's weights.
    more = dataclasses.replace(experiment, train=dataclasses.replace(
        experiment.train, init_from=str(tmp_path / "run")))
    assert train(more, tmp_path / "more", progress=False).step == 3
    _, start = _final_params(tmp_path / "run", experiment)
    trainer = Trainer(more, tmp_path / "more")  # at step 0: the finished run's weights
    chex.assert_trees_all_equal(trainer.state.params, start)
    trainer.close()


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_stops_and_names_itself(tmp_path, corpus, monkeypatch, capsys, number):
    experiment = tiny("gpt_char", corpus)
    batch = TextFeed.train

    def signalled(feed, step):  # the signal arrives while step 2 runs
        if step == 1:
            signal.raise_signal(number)
        return batch(feed, step)

    monkeypatch.setattr(TextFeed, "train", signalled)
    result = train(experiment, tmp_path, progress=False)
    assert (result.step, result.signal, result.interrupted) == (2, number, True)
    assert (tmp_path / "checkpoints" / "2").is_dir()
    name = signal.Signals(number).name
    assert f"{name}: saving step 2, then stopping" in capsys.readouterr().out  # said at once
    monkeypatch.undo()
    assert train(experiment, tmp_path, progress=False).signal is None


def test_a_signal_before_the_first_step_stops_without_a_step_or_a_save(tmp_path, corpus,
                                                                        monkeypatch):
    restore = Trainer.restore

    def signalled(trainer, **kwargs):  # the signal arrives while the run restores
        signal.raise_signal(signal.SIGINT)
        return restore(trainer, **kwargs)

    monkeypatch.setattr(Trainer, "restore", signalled)
    monkeypatch.setattr(Trainer, "train_batch", lambda *_: pytest.fail("a step was run"))
    with warnings.catch_warnings():  # the plot without a curve once warned of its legend
        warnings.simplefilter("error", UserWarning)
        result = train(tiny("gpt_char", corpus), tmp_path, progress=False)
    assert (result.step, result.signal) == (0, signal.SIGINT)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]


def test_mfu_counts_every_device_and_says_which_peak(corpus, monkeypatch):
    monkeypatch.setattr(loop, "matmul_peak_flops", lambda: 1e9)
    monkeypatch.setattr(loop.jax, "device_count", lambda: 4)  # the step runs on all four
    trainer = SimpleNamespace(experiment=tiny("gpt_char", corpus), feed=SimpleNamespace(
        tokens_per_batch=128), state=SimpleNamespace(params=nnx.State({}),
                                                     frozen=nnx.State({})))
    clock = loop._Clock(trainer)
    assert clock.peaks["mfu_measured"] == 4e9
    metrics = {"loss": 1.5, "tokens_per_s": 100.0, "mfu_measured": 0.41}
    assert clock.describe(metrics) == "loss=1.500, tok/s=100, MFU 41% of measured peak"
    assert clock.describe({**metrics, "mfu": 0.2}).endswith(
        "MFU 20% of bf16 peak (41% of measured peak)")


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
        moe={"jitter": 0.1, "capacity_factor": 1.0}))
    result = train(experiment, tmp_path, progress=False)
    assert result.step == 4 and np.isfinite(result.validation["loss"])
    train_records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert all(1.0 <= r["load_balancing_loss"] <= 8.0 for r in train_records)
    assert all(r["router_z_loss"] > 0 for r in train_records)


def test_a_resumed_run_says_from_which_step(tmp_path, corpus, capsys):
    experiment = tiny("gpt_char", corpus, steps=2, log_every=1, eval_every=2,
                      checkpoint_every=1)
    train(experiment, tmp_path, progress=False)
    assert "resumed" not in capsys.readouterr().out
    shutil.rmtree(tmp_path / "checkpoints" / "2")
    train(experiment, tmp_path, progress=False)
    assert "resumed from step 1" in capsys.readouterr().out


def test_an_empty_workdir_path_is_refused(corpus):
    # pathlib reads "" as ".": the run went into the current directory.
    with pytest.raises(ValueError, match="workdir must not be an empty path"):
        train(tiny("gpt_char", corpus), "", progress=False)


def test_a_workdir_that_cannot_be_written_is_named(tmp_path, corpus):
    # Tests run as root, whom chmod does not stop: a regular file where a folder must be.
    (tmp_path / "file").write_text("")
    workdir = tmp_path / "file" / "run"
    with pytest.raises(OSError, match=f"cannot write in the workdir {workdir}"):
        train(tiny("gpt_char", corpus), workdir, progress=False)


def test_a_full_disk_while_logging_names_the_metrics_file(tmp_path, monkeypatch):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.close()
    with open("/dev/full", "a") as full:  # every write fails with ENOSPC, naming no file
        monkeypatch.setattr(writer, "_file", full)
        with pytest.raises(OSError, match=r"No space left on device: '.*metrics\.jsonl'"):
            writer.write(1, {"loss": 1.0})
        with pytest.raises(OSError, match=r"metrics\.jsonl"):  # the unwritten line, again
            writer.close()


def test_a_failed_background_save_stops_the_run_at_the_next_step(tmp_path, corpus, monkeypatch):
    from orbax.checkpoint._src.serialization import serialization

    async def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serialization, "async_serialize_from_host", disk_full)
    experiment = tiny("gpt_char", corpus, steps=200, checkpoint_every=100, log_every=1,
                      eval_every=1000)
    with pytest.raises(OSError, match="No space left") as info:
        train(experiment, tmp_path, progress=False)
    assert "step 100" in "\n".join(info.value.__notes__)
    # Reported within steps of the failure, not at the next save (step 200).
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert 100 <= max(r["step"] for r in records) < 200
