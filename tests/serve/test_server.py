"""`tfx.serve` answers OpenAI's own client (the `openai` package) the way OpenAI would, with
the tokens `tfx.generate` gives each request alone: completions, chat, streaming, two LoRA
adapters and the base in one batch, stop strings, seeds, log-probabilities, and errors in
OpenAI's shape that leave the server serving."""

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from serve_cases import reference

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny):
    from tfx.serve import load_served, serving

    served = load_served(tiny.folder, {name: str(f) for name, f in tiny.adapters.items()},
                         name="tiny")
    with serving(served, num_pages=64, page_size=8, max_batch=4, chunk=16) as url:
        yield url, served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0)


def _http(url, body: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of a GET, or of a POST of `body` as JSON."""
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _ids(served, text):
    return [int(i) for i in served.tokenizer.encode(text)]


def test_completion_is_the_greedy_continuation(server, client, tiny):
    _, served = server
    answer = client.completions.create(model="tiny", prompt="Hello there", max_tokens=7,
                                       temperature=0.0)
    prompt = _ids(served, "Hello there")
    expected = reference(tiny.folder, prompt, 7, eos=list(served.eos))
    assert answer.choices[0].text == served.tokenizer.decode(expected)
    assert answer.choices[0].finish_reason == ("stop" if len(expected) < 7 else "length")
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == len(expected)
    assert answer.object == "text_completion" and answer.model == "tiny"


def test_chat_uses_the_checkpoints_template_and_stops_at_the_end_of_turn(server, client, tiny):
    _, served = server
    messages = [{"role": "user", "content": "What is two plus two?"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                            temperature=0.0)
    prompt, _ = served.tokenizer.encode_chat(messages, add_generation_prompt=True)
    eos = [served.tokenizer.eos_id, *served.eos]
    expected = reference(tiny.folder, prompt.tolist(), 12, eos=eos)
    message = answer.choices[0].message
    assert message.role == "assistant"
    assert message.content == served.tokenizer.decode(expected)
    assert answer.usage.completion_tokens == len(expected)
    assert answer.usage.prompt_tokens == len(prompt)


def test_streamed_chunks_add_up_to_the_whole_answer(client):
    messages = [{"role": "user", "content": "Hello!"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                           temperature=0.0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0.0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    pieces = list(client.completions.create(model="tiny", prompt="Who jumps", max_tokens=6,
                                            temperature=0.0, stream=True))
    plain = client.completions.create(model="tiny", prompt="Who jumps", max_tokens=6,
                                      temperature=0.0)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text


def test_two_adapters_and_the_base_decode_in_one_batch(server, tiny):
    url, served = server
    prompt = _ids(served, "The quick brown fox")

    async def ask(model):
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
        async with client:
            answer = await client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                                     temperature=0.0)
            return answer.choices[0].text

    async def all_at_once():
        return await asyncio.gather(*(ask(m) for m in ("terse", "chatty", "tiny", "terse")))

    texts = asyncio.run(all_at_once())
    expected = {name: served.tokenizer.decode(reference(
        tiny.folder, prompt, 8, adapter=tiny.adapters.get(name), eos=list(served.eos)))
        for name in ("terse", "chatty", "tiny")}
    assert texts == [expected["terse"], expected["chatty"], expected["tiny"], expected["terse"]]
    assert len(set(expected.values())) == 3  # the adapters change the answer


def test_models_lists_the_base_and_its_adapters(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "terse", "chatty"]


def test_stop_strings_end_the_text_before_them(client):
    plain = client.completions.create(model="tiny", prompt="Write add.", max_tokens=12,
                                      temperature=0.0).choices[0].text
    stop = plain[3:5]
    assert stop and len(plain) > 5
    cut = client.completions.create(model="tiny", prompt="Write add.", max_tokens=12,
                                    temperature=0.0, stop=[stop, "never appears"])
    assert cut.choices[0].text == plain[:plain.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="Write add.", max_tokens=12,
                                         temperature=0.0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_a_seed_fixes_the_samples_and_n_draws_distinct_ones(client):
    def sample(seed):
        answer = client.completions.create(model="tiny", prompt="Hello", max_tokens=10,
                                           temperature=1.0, top_p=0.95, n=3,
                                           extra_body={"top_k": 50},
                                           seed=seed)
        assert [c.index for c in answer.choices] == [0, 1, 2]
        return [c.text for c in answer.choices]

    first = sample(7)
    assert sample(7) == first
    assert len(set(first)) > 1 and sample(8) != first


def test_logprobs_are_those_of_the_chosen_tokens(server, client):
    _, served = server
    answer = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                       temperature=0.0, logprobs=0)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.token_logprobs) == answer.usage.completion_tokens
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == answer.choices[0].text or served.eos
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "Hi"}],
                                          max_tokens=4, temperature=0.0, logprobs=True)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 10_000}, 400, None),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, 422, "temperature"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 10**6]}, 400, None),
    ({"model": "tiny", "prompt": "hi", "presence_penalty": 1.0}, 422, "presence_penalty"),
    ({"model": "tiny"}, 422, "prompt"),
])
def test_bad_requests_get_openai_errors(server, client, body, status, param):
    code, answer = _http(f"{server[0]}/completions", json.dumps(body).encode())
    assert code == status, answer
    error = answer["error"]
    assert error["message"] and error["type"] and error["param"] == param
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices


def test_malformed_json_and_unknown_routes(server):
    url = server[0]
    code, answer = _http(f"{url}/chat/completions", b"{not json")
    assert code == 400 and "JSON" in answer["error"]["message"]
    code, answer = _http(f"{url}/nothing")
    assert code == 404 and "error" in answer
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        openai.OpenAI(base_url=url, api_key="x", max_retries=0).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}])


def test_health_reports_the_pages(server):
    _, health = _http(server[0].removesuffix("/v1") + "/health")
    assert health["status"] == "ok" and health["pages"] == 64
    assert json.loads(json.dumps(health))["free_pages"] <= 64
    assert np.isscalar(health["requests"])
