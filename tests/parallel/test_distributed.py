"""tfx.parallel.distributed in this single-process, single-device pytest process: argument and
environment handling of `initialize` (up to, never into, jax.distributed) and the batch helpers.
test_multiprocess.py runs real multi-process training."""

import jax
import numpy as np
import pytest

from tfx.parallel import (
    batch_sharding,
    global_batch,
    initialize,
    make_mesh,
    process_row_range,
    process_rows,
)

ENV = ("TFX_COORDINATOR_ADDRESS", "TFX_NUM_PROCESSES", "TFX_PROCESS_ID")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_distributed(monkeypatch):
    """Fail the test if jax.distributed.initialize is reached."""
    def refuse(**kwargs):
        raise AssertionError(f"jax.distributed.initialize called with {kwargs}")
    monkeypatch.setattr(jax.distributed, "initialize", refuse)


def test_single_process_is_a_no_op(no_distributed, monkeypatch):
    assert initialize() is False
    assert initialize(num_processes=1, process_id=0) is False
    monkeypatch.setenv("TFX_NUM_PROCESSES", "1")
    assert initialize(coordinator_address="127.0.0.1:1") is False


def test_arguments_and_environment_reach_jax(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *args: calls.append(args))
    assert initialize("10.0.0.1:1234", 4, 3) is True
    monkeypatch.setenv("TFX_COORDINATOR_ADDRESS", "10.0.0.2:99")
    monkeypatch.setenv("TFX_NUM_PROCESSES", "2")
    monkeypatch.setenv("TFX_PROCESS_ID", "1")
    assert initialize() is True
    assert initialize(process_id=0) is True  # an argument wins over the environment
    wanted = [dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3),
              dict(coordinator_address="10.0.0.2:99", num_processes=2, process_id=1),
              dict(coordinator_address="10.0.0.2:99", num_processes=2, process_id=0)]
    gloo = ("jax_cpu_collectives_implementation", "gloo")
    assert calls == [gloo, wanted[0], gloo, wanted[1], gloo, wanted[2]]


@pytest.mark.parametrize("kwargs, env, error, message", [
    (dict(num_processes=2, process_id=0), {}, ValueError, "coordinator_address"),
    (dict(coordinator_address="h:1", num_processes=2), {}, ValueError,
     r"process_id \(or TFX_PROCESS_ID\) must be in \[0, 2\), got None"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), {}, ValueError,
     r"must be in \[0, 2\), got 2"),
    (dict(num_processes=0), {}, ValueError, "num_processes must be >= 1, got 0"),
    ({}, {"TFX_COORDINATOR_ADDRESS": "h:1"}, ValueError,
     r"num_processes \(or TFX_NUM_PROCESSES\) is required with coordinator_address 'h:1'"),
    (dict(num_processes="2"), {}, TypeError, "num_processes must be an int, got str"),
    ({}, {"TFX_NUM_PROCESSES": "two"}, ValueError,
     "TFX_NUM_PROCESSES must be an integer, got 'two'"),
])
def test_bad_settings_raise_before_jax_is_touched(no_distributed, monkeypatch, kwargs, env,
                                                   error, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(error, match=message):
        initialize(**kwargs)


def test_one_process_holds_every_row():
    rows = batch_sharding(make_mesh())
    batch = {"tokens": np.arange(24, dtype=np.int32).reshape(6, 4),
             "mask": np.ones((6, 4), bool)}
    assert process_row_range(6, rows) == (0, 6)
    local = process_rows(batch, rows)
    np.testing.assert_array_equal(local["tokens"], batch["tokens"])
    out = global_batch(local, rows)
    assert out["tokens"].sharding == rows and out["tokens"].shape == (6, 4)
    np.testing.assert_array_equal(np.asarray(out["tokens"]), batch["tokens"])
    with pytest.raises(ValueError, match=r"one leading size, got \[5, 6\]"):
        process_rows({"a": np.zeros((6, 1)), "b": np.zeros((5, 1))}, rows)
