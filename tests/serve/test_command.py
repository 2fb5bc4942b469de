"""`tfx serve` from the command line: it prints where it listens, answers the client, and on
SIGTERM lets the stream in flight finish before it exits 143 with one line; a client that drops
its stream frees the request's pages at once; bad options fail before any model loads."""

import asyncio
import os
import re
import signal
import subprocess
import sys

import pytest

from tfx.cli import main

openai = pytest.importorskip("openai")


def test_sigterm_finishes_the_stream_in_flight_then_exits(tiny):
    server = subprocess.Popen(
        [sys.executable, "-m", "tfx", "serve", str(tiny.folder), "--port", "0", "--name",
         "tiny", "--adapter", f"terse={tiny.adapters['terse']}", "--max-batch", "2"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        line = server.stderr.readline()
        address = re.search(r"http://\S+/v1", line)
        assert address, line
        client = openai.OpenAI(base_url=address[0], api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "terse"]
        stream = client.completions.create(model="terse", prompt="Hello", max_tokens=200,
                                           temperature=0.0, stream=True)
        chunks = [next(iter(stream))]
        server.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert server.wait(timeout=60) == 128 + signal.SIGTERM
        assert server.stderr.read().strip() == "tfx serve: stopped by SIGTERM"
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
    finally:
        if server.poll() is None:
            server.kill()
        server.stderr.close()


def test_a_dropped_stream_frees_its_pages_at_once(tiny):
    from tfx.generation import Engine
    from tfx.serve import load_served
    from tfx.serve.choices import Choices
    from tfx.serve.protocol import CompletionRequest
    from tfx.serve.worker import EngineWorker

    served = load_served(tiny.folder, name="tiny")
    worker = EngineWorker(Engine(served.model, num_pages=32, page_size=8, max_batch=2))
    worker.start()

    async def drop_after_one_delta():
        body = CompletionRequest(model="tiny", prompt=[1, 2, 3], max_tokens=200, temperature=0)
        choices = Choices(worker, served.tokenizer, body, [1, 2, 3], max_tokens=200, eos=(),
                          variant=0)
        await choices.start()
        deltas = choices.deltas()
        first = await anext(deltas)
        await deltas.aclose()  # what Starlette does to the stream of a client that left
        pending, free = await worker.call(lambda e: (e.num_pending, e.allocator.num_free))
        return first, pending, free

    try:
        first, pending, free = asyncio.run(drop_after_one_delta())
    finally:
        worker.stop()
    assert first.tokens and first.finish_reason is None
    assert (pending, free) == (0, 32)


@pytest.mark.parametrize("args, message", [
    (["--adapter", "broken"], "--adapter must be NAME=DIR"),
    (["--adapter", "a=x", "--adapter", "a=y"], "names 'a' twice"),
    (["--port", "70000"], "--port must be in"),
])
def test_bad_options_fail_with_one_line(tiny, capsys, args, message):
    assert main(["serve", str(tiny.folder), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_missing_path_is_refused(capsys, tmp_path):
    pytest.importorskip("fastapi")
    assert main(["serve", str(tmp_path / "nothing")]) == 2
    assert "PATH must be a tfx run or a Hugging Face folder" in capsys.readouterr().err
