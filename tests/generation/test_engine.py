"""tfx.generation.Engine: continuous batching over a paged cache gives every greedy request the
tokens of `tfx.generate` run on that request alone, whatever joins or leaves around it; pages
are reused and all free at the end; two compiled programs; bad requests fail at submit."""

import jax
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.generation import Engine
from tfx.generation.pages import PageAllocator
from tfx.models import Decoder, DecoderConfig

VOCAB = 50


def _decoder(position="rope", scan=False, **changes):
    config = DecoderConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4,
                           attention={"num_kv_heads": 2, **changes}, d_ff=64, max_len=48,
                           position=position, compute={"scan_layers": scan})
    return Decoder(config, rngs=nnx.Rngs(0))


def _alone(model, prompt, new, eos=None):
    """Reference: tfx.generate on this request alone, cut after its first EOS. Greedy tokens do
    not depend on how many follow, so every reference runs MAX_NEW and keeps `new`: one
    compiled program per prompt bucket instead of one per max_new_tokens."""
    out = np.asarray(tfx.generate(model, [prompt], max_new_tokens=MAX_NEW, temperature=0.0,
                                  eos_token_id=eos))[0, len(prompt):len(prompt) + new]
    ends = np.flatnonzero(out == eos) if eos is not None else []
    return out[:ends[0] + 1] if len(ends) else out


# Prompts longer than the chunk (8), of one token, and between; new tokens 1 to 9.
REQUESTS = [(21, 6), (3, 9), (1, 5), (12, 1), (7, 8), (17, 4)]
MAX_NEW = 9


@pytest.mark.parametrize("position, scan", [("rope", False), ("learned", True)])
def test_greedy_tokens_equal_generate_alone_under_random_arrivals(position, scan):
    model = _decoder(position, scan)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n, _ in REQUESTS]
    news = [new for _, new in REQUESTS]
    expected = [_alone(model, p, n) for p, n in zip(prompts, news, strict=True)]
    # One request ends on EOS: the token its reference emits third.
    eos = [None] * len(prompts)
    eos[1] = int(expected[1][2])
    expected[1] = _alone(model, prompts[1], news[1], eos[1])
    needs = [-(-(len(p) + n - 1) // 4) for p, n in zip(prompts, news, strict=True)]
    num_pages = max(needs) + 2
    assert num_pages < sum(needs)  # pages must be freed and reused
    engine = Engine(model, num_pages=num_pages, page_size=4, max_batch=3, chunk=8)
    order, ids, stepped = rng.permutation(len(prompts)), {}, []
    for i in order:  # submitted between steps, in a random order
        ids[engine.submit(prompts[i], max_new_tokens=news[i], eos_token_id=eos[i])] = i
        stepped += engine.step()
    results = engine.run()  # those the steps finished included, by request id
    assert [r.request_id for r in results] == list(range(len(prompts)))
    assert {r.request_id for r in stepped} < set(ids) and stepped
    for result in results:
        i = ids[result.request_id]
        np.testing.assert_array_equal(result.tokens, expected[i], err_msg=f"request {i}")
        assert result.finish_reason == ("eos" if i == 1 else "length")
    assert engine.allocator.num_free == num_pages and engine.num_pending == 0


def test_generate_returns_results_in_prompt_order_and_compiles_two_programs():
    model = _decoder()
    prompts = [[1, 2, 3], list(range(5, 25)), [7]]
    engine = Engine(model, num_pages=12, page_size=4, max_batch=2, chunk=8)
    results = engine.generate(prompts, max_new_tokens=[4, 6, 3])
    assert [r.request_id for r in results] == [0, 1, 2]
    for prompt, new, result in zip(prompts, [4, 6, 3], results, strict=True):
        np.testing.assert_array_equal(result.tokens, _alone(model, prompt, new))
    assert engine.num_programs == 2  # [max_batch, chunk] and [max_batch, 1]


def test_sampled_tokens_do_not_depend_on_the_other_requests():
    model = _decoder()
    key = jax.random.key(3)
    alone = Engine(model, num_pages=8, page_size=4, max_batch=2, chunk=8)
    alone.submit([4, 5, 6], max_new_tokens=8, temperature=1.0, rng=key)
    first = alone.run()[0]
    crowded = Engine(model, num_pages=8, page_size=4, max_batch=2, chunk=8)
    crowded.submit(list(range(10)), max_new_tokens=5)
    crowded.step()
    request = crowded.submit([4, 5, 6], max_new_tokens=8, temperature=1.0, rng=key)
    again = next(r for r in crowded.run() if r.request_id == request)
    np.testing.assert_array_equal(again.tokens, first.tokens)
    other = alone.generate([[4, 5, 6]], max_new_tokens=8, temperature=1.0, rng=key)[0]
    assert not np.array_equal(other.tokens, first.tokens)


def test_page_allocator_reuses_released_pages_first():
    pages = PageAllocator(4)
    first = pages.allocate(3)
    assert first == [0, 1, 2] and pages.num_free == 1
    pages.release([1])
    assert pages.allocate(1) == [1]
    with pytest.raises(ValueError, match="cannot allocate 2 pages: 1 of 4 are free"):
        pages.allocate(2)
    with pytest.raises(ValueError, match="page 3 is not an allocated page"):
        pages.release([3])
    with pytest.raises(ValueError, match="num_pages must be an int >= 1"):
        PageAllocator(0)


@pytest.mark.parametrize("changes, match", [
    (dict(position="alibi"), "position='alibi'"),
    (dict(sliding_window=4), "sliding-window layers"),
])
def test_models_a_paged_cache_cannot_serve(changes, match):
    position = changes.pop("position", "rope")
    with pytest.raises(ValueError, match=match):
        Engine(_decoder(position, **changes), num_pages=4)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(prompt=[]), ValueError, "input_ids"),
    (dict(prompt=[1, VOCAB]), ValueError, r"\[0, 50\)"),
    (dict(prompt=[[1, 2], [3, 4]]), ValueError, "one sequence"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=46), ValueError, "exceeds the model's max_len"),
    (dict(max_new_tokens=30), ValueError, "needs 8 pages of 4 tokens, more than the pool's"),
    (dict(temperature=0.5), ValueError, "rng must be a jax.random key"),
    (dict(temperature=-1.0), ValueError, "temperature must be a finite number >= 0"),
    (dict(eos_token_id=VOCAB), ValueError, "eos_token_id must be token ids"),
    (dict(temperature=1.0, rng=np.zeros(3, np.uint32)), ValueError, "rng must be"),
])
def test_bad_requests_fail_at_submit(kwargs, error, match):
    engine = Engine(_decoder(), num_pages=7, page_size=4, max_batch=2, chunk=8)
    request = dict(prompt=[1, 2, 3], max_new_tokens=4) | kwargs
    with pytest.raises(error, match=match):
        engine.submit(request.pop("prompt"), **request)
    assert engine.num_pending == 0


def test_bad_engine_arguments():
    model = _decoder()
    with pytest.raises(TypeError, match="model must be a tfx Decoder"):
        Engine(object(), num_pages=4)
    for name in ("num_pages", "page_size", "max_batch", "chunk"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
            Engine(model, **{"num_pages": 4, name: 0})
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        Engine(model, num_pages=4).generate([[1], [2]], max_new_tokens=[3])
