"""SIGINT and SIGTERM in `tfx train` and the training loop: never an exception raised wherever
the signal lands.

Python's default SIGINT handler raises KeyboardInterrupt at the main thread's next bytecode,
which may be inside one of XLA's callbacks or an asyncio loop that orbax runs. A Ctrl-C near the
end of `tfx train` was then swallowed ("Exception ignored in: <function _xla_gc_callback>"), or
orbax's worker threads printed "Event loop is closed" tracebacks, or a restore in flight read as
a damaged checkpoint, or the interpreter crashed in its teardown with XLA's threads still
running. So a signal is handled in one of two ways, both jax-free:

- `StopFlag` where there is work to save (the training loop): the first signal sets a flag that
  the loop reads between steps; a second gets the handler that was there before.
- `ExitAtOnce` where there is none (a command's start-up, its closing sample): the process ends
  at once with one line, skipping the interpreter's teardown.

`handling(handler)` installs either for a block and then restores the handlers it found.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["SIGNALS", "ExitAtOnce", "StopFlag", "handling"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)

Handler = TypeVar("Handler", bound=Callable)


def _installed() -> dict[int, Callable | int]:
    """The handlers of SIGNALS now (one not set from Python reads as the default)."""
    return {s: signal.getsignal(s) or signal.SIG_DFL for s in SIGNALS}


@contextlib.contextmanager
def handling(handler: Handler) -> Iterator[Handler]:
    """Install `handler` for SIGINT and SIGTERM for the block, then restore the handlers it
    found. Outside the main thread, where Python cannot set handlers, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield handler
        return
    previous = _installed()
    for number in SIGNALS:
        signal.signal(number, handler)
    try:
        yield handler
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


class StopFlag:
    """A handler that records the first SIGINT/SIGTERM: `signum` (None until one comes) is the
    flag to read at safe points. A second signal gets the handler installed when the flag was
    made (`tfx train`'s `ExitAtOnce`; in Python, the default raises KeyboardInterrupt)."""

    def __init__(self):
        self.signum: int | None = None
        self.previous = _installed()

    def __call__(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        signal.signal(signum, self.previous[signum])
        signal.raise_signal(signum)


class ExitAtOnce:
    """A handler that ends the process at once: stdout and stderr flushed, `line(name of the
    signal)` on stderr, exit status 128 + the signal's number.

    For the phases of a command that leave nothing to save. `os._exit` skips the interpreter's
    teardown, so no thread of XLA or orbax still running meets a half-finalized interpreter.
    `line` may be replaced as the command goes on, to say what the signal left behind."""

    def __init__(self, line: Callable[[str], str]):
        self.line = line

    def __call__(self, signum: int, frame) -> None:
        for stream in (sys.stdout, sys.stderr):
            # A print that the signal interrupted holds the stream's buffer: the flush then
            # raises, and what it held is lost, not the line below.
            with contextlib.suppress(Exception):
                stream.flush()
        os.write(2, f"{self.line(signal.Signals(signum).name)}\n".encode())
        os._exit(128 + signum)
