"""Multi-process data-parallel training: two processes on 127.0.0.1, 2 CPU devices each, joined
by tfx.parallel.initialize (gloo collectives), train the tiny char-gpt of _train_case.py over a
data=2 × fsdp=2 mesh, each feeding only its own half of every batch; a third, plain process
trains on one device with the whole batches. The results must agree."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from parallel._train_case import BATCH, assert_same_training

WORKER = pathlib.Path(__file__).with_name("_multiprocess_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(out: pathlib.Path, **env) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    for name in ("TFX_COORDINATOR_ADDRESS", "TFX_NUM_PROCESSES", "TFX_PROCESS_ID"):
        env.setdefault(name, "")
    return subprocess.Popen([sys.executable, str(WORKER), str(out)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(procs: list[subprocess.Popen]) -> None:
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            proc.kill()  # only if still running (a peer failed or timed out)
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-5000:]


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    procs = [start(tmp_path / "multi", TFX_COORDINATOR_ADDRESS=address, TFX_NUM_PROCESSES="2",
                   TFX_PROCESS_ID=str(i)) for i in range(2)]
    procs.append(start(tmp_path / "single"))
    finish(procs)

    rows = [json.loads((tmp_path / f"multi.{i}.rows.json").read_text()) for i in range(2)]
    assert [r["rows"] for r in rows] == [[0, BATCH // 2], [BATCH // 2, BATCH]]
    assert all(r["process_count"] == 2 and r["devices"] == 4 and r["local_devices"] == 2
               for r in rows)
    multi, single = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("multi", "single"))
    assert multi["specs"]["params/stack/layers/0/mlp/up/kernel"] == "P('fsdp',)"
    assert multi["shards"]["opt_state/1/0/nu/stack/layers/0/mlp/up/kernel"] == [32, 128]
    with np.load(tmp_path / "multi.npz") as a, np.load(tmp_path / "single.npz") as b:
        assert_same_training(multi["losses"], dict(a), single["losses"], dict(b))
