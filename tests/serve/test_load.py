"""Under a bounded load on the loopback address (hundreds of concurrent requests, streamed and
whole, some cancelled mid-stream by their client) nothing leaks and nothing mixes: every page is
free at the end, and every finished request's text is that of `tfx.generate` on it alone."""

import asyncio
import json
import time
import urllib.request

import pytest
from serve_cases import reference

openai = pytest.importorskip("openai")

PROMPTS = ["Hello", "What is one plus one?", "def add(a, b):", "The quick brown fox jumps",
           "Who", "Write add. Then write sub, and mul, and div too."]
LENGTHS = [1, 3, 8, 17]
REQUESTS = 240


def _health(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as response:
        return json.load(response)


async def _one(client, i: int) -> tuple[int, str | None]:
    """Request i: its prompt and length by i; streamed when i is odd; every seventh is dropped
    by its client after the first chunk (None)."""
    prompt, max_tokens = PROMPTS[i % len(PROMPTS)], LENGTHS[i // len(PROMPTS) % len(LENGTHS)]
    settings = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    if i % 2 == 0:
        return i, (await client.completions.create(**settings)).choices[0].text
    stream = await client.completions.create(**settings, stream=True)
    text = ""
    async for chunk in stream:
        text += chunk.choices[0].text
        if i % 7 == 0:
            await stream.close()  # the client goes away mid-stream
            return i, None
    return i, text


def test_hundreds_of_concurrent_requests_leak_nothing(tiny):
    from tfx.serve import load_served, serving

    served = load_served(tiny.folder, name="tiny")
    pages = 40  # fewer than 8 requests of 17 new tokens need: requests wait for pages
    with serving(served, num_pages=pages, page_size=4, max_batch=8, chunk=8) as url:

        async def everything():
            client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0,
                                        timeout=300)
            async with client:
                return await asyncio.gather(*(_one(client, i) for i in range(REQUESTS)))

        answers = dict(asyncio.run(everything()))
        deadline = time.monotonic() + 30
        while (health := _health(url))["requests"] and time.monotonic() < deadline:
            time.sleep(0.1)  # a dropped stream's cancel reaches the engine between steps
        assert health == {"status": "ok", "pages": pages, "free_pages": pages, "requests": 0}
    expected = {}
    for prompt in PROMPTS:
        ids = [int(t) for t in served.tokenizer.encode(prompt)]
        tokens = reference(tiny.folder, ids, max(LENGTHS), eos=list(served.eos))
        expected[prompt] = {n: served.tokenizer.decode(tokens[:n]) for n in LENGTHS}
    finished = 0
    for i, text in answers.items():
        if text is None:
            continue
        finished += 1
        prompt = PROMPTS[i % len(PROMPTS)]
        assert text == expected[prompt][LENGTHS[i // len(PROMPTS) % len(LENGTHS)]], i
    assert finished == sum(i % 14 != 7 for i in range(REQUESTS))
