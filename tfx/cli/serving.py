"""`tfx serve PATH`: load the model and its adapters, then serve them (`tfx.serve`)."""

from __future__ import annotations

import math
import signal
import sys

__all__ = ["serve"]


def serve(command) -> int:
    """Serve until SIGINT or SIGTERM (exit 130 / 143 once the requests in flight are done);
    the address is printed once the socket listens."""
    try:
        import tfx.serve as serving
    except ImportError as error:
        raise ValueError(f"tfx serve needs the serve extra (pip install 'tfx[serve]'): "
                         f"{error}") from None
    if not 0 <= command.port < 2**16:
        raise ValueError(f"--port must be in [0, 65535], got {command.port}")
    adapters = serving.parse_adapters(command.adapter)
    served = serving.load_served(command.path, adapters, name=command.name,
                                 max_len=command.max_len)
    pages = command.pages or command.max_batch * math.ceil(served.model.config.max_len
                                                           / command.page_size)

    def ready(address):
        print(f"tfx serve: {served.name} ({len(served.adapters)} adapters) on "
              f"http://{address}/v1", file=sys.stderr, flush=True)

    stopped_by = serving.serve(served, host=command.host, port=command.port, num_pages=pages,
                               page_size=command.page_size, max_batch=command.max_batch,
                               chunk=command.chunk, prefix_cache=command.prefix_cache,
                               on_ready=ready)
    if stopped_by is None:
        raise OSError(f"could not serve on {command.host}:{command.port}")
    print(f"tfx serve: stopped by {signal.Signals(stopped_by).name}", file=sys.stderr)
    return 128 + stopped_by
