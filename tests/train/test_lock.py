"""The workdir lock: a second run is refused at once, naming the holder's process id, and a
killed holder frees the workdir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from train_cases import tiny, write_corpus

from tfx.train.lock import WorkdirBusyError, WorkdirLock
from tfx.train.loop import train

HOLD = """
import sys, time
from tfx.train.lock import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock on tmp_path / "run"."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "held\n"
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_second_process_is_refused_until_the_holder_is_killed(tmp_path, holder):
    workdir = tmp_path / "run"
    assert (workdir / ".lock").read_text() == f"{holder.pid}\n"
    with pytest.raises(WorkdirBusyError, match=rf"in use by .*process id {holder.pid}\)"):
        WorkdirLock(workdir).acquire()
    holder.send_signal(signal.SIGKILL)  # a crash: the OS drops the lock
    holder.wait()
    with WorkdirLock(workdir) as lock:
        assert lock.path.read_text() == f"{os.getpid()}\n"
    assert lock.path.read_text() == ""  # released: no stale process id


def test_train_is_refused_before_it_touches_the_runs_files(tmp_path, holder):
    # Before the lock, the second run deleted the first's checkpoint being written (orbax
    # removes temporary steps when it opens the folder) and doubled its metrics lines.
    workdir = tmp_path / "run"
    in_flight = workdir / "checkpoints" / "6.orbax-checkpoint-tmp-1700000000000000"
    in_flight.mkdir(parents=True)
    (workdir / "metrics.jsonl").write_text('{"step": 5, "split": "train", "loss": 2.0}\n')
    before = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
    experiment = tiny("gpt_char", write_corpus(tmp_path), steps=2)
    with pytest.raises(ValueError, match=f"process id {holder.pid}"):
        train(experiment, workdir, progress=False)
    assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before
    assert (workdir / "metrics.jsonl").read_text().count("\n") == 1


def test_a_second_lock_in_the_same_process_is_refused(tmp_path):
    with WorkdirLock(tmp_path), pytest.raises(WorkdirBusyError,
                                              match=f"process id {os.getpid()}"):
        WorkdirLock(tmp_path).acquire()
    WorkdirLock(tmp_path).acquire().release()  # free again


def test_an_unwritable_workdir_is_named(tmp_path):
    # Tests run as root, whom chmod does not stop: a regular file where a folder must be.
    (tmp_path / "file").write_text("")
    workdir = tmp_path / "file" / "run"
    with pytest.raises(OSError, match=f"cannot write in the workdir {workdir}: Not a directory"):
        WorkdirLock(workdir).acquire()
