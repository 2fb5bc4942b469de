"""The one thread that owns the device: it drives `tfx.generation.Engine` and tells each
request's listener what happened, while the HTTP handlers run on the asyncio loop.

Handlers never touch the engine. They post commands (submit, cancel) to a queue; between steps
the worker applies them, so requests join and leave between steps. After each step it sends
every listener its new tokens, and the result of each request that finished, onto the
listeners' asyncio queues: one `loop.call_soon_threadsafe` per step, so the event loop wakes
once a step, not once a token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable

from tfx.generation import Engine, Result

__all__ = ["EngineWorker", "Listener", "Update", "deliver"]


@dataclasses.dataclass(frozen=True)
class Update:
    """What a listener hears about one request: its tokens and log-probabilities so far, and
    its finish reason once it ended ("eos", "length"; "error" with `error` set when the server
    stopped first)."""

    request_id: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    error: str | None = None


class Listener:
    """An asyncio queue of `Update`s that the worker thread fills (through `deliver`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()


def deliver(updates: list[tuple[Listener, Update]]) -> None:
    """Hand a step's updates to their listeners: one wake-up of each event loop per step
    (called on the worker thread), however many requests the step served."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for listener, update in updates:
        by_loop.setdefault(listener.loop, []).append((listener.queue, update))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
            loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch) -> None:
    for queue_, update in batch:
        queue_.put_nowait(update)


class EngineWorker:
    """Run `engine` on a thread of its own until `stop()`.

    >>> worker = EngineWorker(engine); worker.start()
    >>> ids = await worker.submit([dict(prompt=ids, max_new_tokens=8)], listener)
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._listeners: dict[int, Listener] = {}
        self._reported: dict[int, int] = {}  # tokens each listener has heard of
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tfx-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str = "the server is shutting down") -> None:
        """Fail every unfinished request with `reason`, free its pages, end the thread."""
        self._commands.put(lambda: self._fail_all(reason))
        self._stopping.set()
        self._commands.put(lambda: None)  # wake a waiting thread
        self._thread.join()

    def submit(self, requests: list[dict], listener: Listener) -> asyncio.Future:
        """Queue `requests` (keyword arguments of `Engine.submit`) for `listener`, all or none:
        a future of their request ids, or of the ValueError that refused one."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command():
            ids = []
            try:
                ids.extend(self.engine.submit(**request) for request in requests)
            except ValueError as error:
                for request_id in ids:
                    self.engine.cancel(request_id)
                future.set_exception(error)
                return
            self._listeners.update((request_id, listener) for request_id in ids)
            future.set_result(ids)

        self._post(command, future)
        return asyncio.wrap_future(future)

    def cancel(self, request_ids: list[int]) -> None:
        """Drop requests (their listener hears no more; their pages are freed)."""
        def command():
            for request_id in request_ids:
                self._listeners.pop(request_id, None)
                self._reported.pop(request_id, None)
                self.engine.cancel(request_id)

        self._commands.put(command)

    def call(self, query: Callable[[Engine], object]) -> asyncio.Future:
        """Run `query(engine)` between steps (e.g. to read how many pages are free)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(lambda: future.set_result(query(self.engine)), future)
        return asyncio.wrap_future(future)

    def _post(self, command: Callable[[], None], future: concurrent.futures.Future) -> None:
        if self._stopping.is_set():
            future.set_exception(RuntimeError("the server is shutting down"))
        else:
            self._commands.put(command)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._apply(block=not self.engine.num_pending)
            if self.engine.num_pending:
                self._report(self.engine.step())
        self._apply(block=False)

    def _apply(self, block: bool) -> None:
        """Run the queued commands; when `block`, wait for the first one."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _report(self, finished: list[Result]) -> None:
        """Tell each listener what changed in this step: new tokens, or the end."""
        done = {result.request_id for result in finished}
        updates = []
        for request_id, listener in list(self._listeners.items()):
            if request_id in done:
                result = self.engine.pop_result(request_id)
                del self._listeners[request_id]
                self._reported.pop(request_id, None)
                updates.append((listener, Update(request_id, result.tokens.tolist(),
                                                 result.logprobs.tolist(),
                                                 result.finish_reason)))
                continue
            tokens, logprobs = self.engine.tokens_so_far(request_id)
            if len(tokens) > self._reported.get(request_id, 0):  # prefill steps add none
                self._reported[request_id] = len(tokens)
                updates.append((listener, Update(request_id, tokens, logprobs)))
        deliver(updates)

    def _fail_all(self, reason: str) -> None:
        for request_id in self._listeners:
            self.engine.cancel(request_id)
        deliver([(listener, Update(request_id, [], [], "error", reason))
                 for request_id, listener in self._listeners.items()])
        self._listeners.clear()
        self._reported.clear()
