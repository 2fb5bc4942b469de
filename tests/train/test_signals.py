"""SIGINT and SIGTERM handlers (tfx.train.signals): a flag that never raises, a second signal
passed to the handler found before, an exit at once with one line, and handlers restored."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tfx.train import signals
from tfx.train.signals import ExitAtOnce, StopFlag, handling


@pytest.mark.parametrize("number", signals.SIGNALS)
def test_the_first_signal_only_sets_the_flag_and_a_second_goes_to_the_handler_before(number):
    heard = []
    with handling(lambda signum, frame: heard.append(signum)), handling(StopFlag()) as stop:
        signal.raise_signal(number)  # no exception: nothing lands inside the code running
        assert (stop.signum, heard) == (number, [])
        signal.raise_signal(number)
        assert heard == [number]
        assert stop.signum == number


def test_handlers_are_restored_after_the_block_even_when_it_raises():
    before = {s: signal.getsignal(s) for s in signals.SIGNALS}
    with pytest.raises(RuntimeError), handling(StopFlag()):
        raise RuntimeError("the block failed")
    assert {s: signal.getsignal(s) for s in signals.SIGNALS} == before


@pytest.mark.parametrize("number", signals.SIGNALS)
def test_exit_at_once_flushes_stdout_writes_one_line_and_exits_128_plus_the_signal(
        number, monkeypatch, capfd):
    def exit_(status):  # os._exit would end the test process
        raise SystemExit(status)

    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises(SystemExit) as exited, handling(
            ExitAtOnce(lambda name: f"tfx x: stopped by {name}")):
        sys.stdout.write("the unfinished line")  # buffered: the flush must show it
        signal.raise_signal(number)
    assert exited.value.code == 128 + number
    out, err = capfd.readouterr()
    assert out == "the unfinished line"
    assert err == f"tfx x: stopped by {signal.Signals(number).name}\n"
