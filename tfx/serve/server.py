"""`tfx serve`: the app on uvicorn, until SIGINT or SIGTERM.

On a signal uvicorn stops accepting connections and waits up to `drain_seconds` for the open
ones (streams included) while the engine keeps stepping, so in-flight requests finish; then the
app's lifespan ends and the engine's thread fails whatever is left, cleanly.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

import uvicorn

from tfx.serve.app import create_app
from tfx.serve.loading import Served

__all__ = ["serve", "serving"]


def serve(served: Served, *, host: str = "127.0.0.1", port: int = 8000, num_pages: int,
          drain_seconds: float = 30.0, on_ready=None, **engine) -> int | None:
    """Serve until SIGINT or SIGTERM; returns that signal's number (None if the server stopped
    otherwise, e.g. it could not bind). on_ready: called with "host:port" once the socket
    listens (port 0 picks a free port). engine: page_size, max_batch, chunk, prefix_cache as
    `create_app`."""
    app = create_app(served, num_pages=num_pages, **engine)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=drain_seconds)
    server = _Server(config, on_ready)
    server.run()
    return server.stopped_by


@contextlib.contextmanager
def serving(served: Served, *, host: str = "127.0.0.1", port: int = 0, num_pages: int,
            drain_seconds: float = 5.0, **engine) -> Iterator[str]:
    """Serve on a thread of this process (a notebook, a test) while the block runs; yields the
    base URL ("http://127.0.0.1:PORT/v1", port 0: a free one). engine: as `serve`."""
    app = create_app(served, num_pages=num_pages, **engine)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=drain_seconds)
    addresses = []
    server = _Server(config, addresses.append)
    thread = threading.Thread(target=server.run, name="tfx-serve", daemon=True)
    thread.start()
    while not addresses:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    try:
        yield f"http://{addresses[0]}/v1"
    finally:
        server.should_exit = True
        thread.join()


class _Server(uvicorn.Server):
    """uvicorn's server, telling when it listens, and returning (not raising again) the
    signal that stopped it, so the command ends with one line and 128 + its number."""

    def __init__(self, config, on_ready):
        super().__init__(config)
        self._on_ready, self.stopped_by = on_ready, None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signals belong to the main thread (`serving` runs on another)
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._stop) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop(self, sig, frame) -> None:
        self.stopped_by = self.stopped_by or sig
        self.handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self._on_ready is not None:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_ready(f"{host}:{port}")
