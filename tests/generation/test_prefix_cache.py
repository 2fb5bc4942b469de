"""tfx.generation.prefix_cache through the Engine: requests that start with the same full
pages of prompt (and weight variant) share them, get the tokens `tfx.generate` gives each one
alone, and leave every page free (or cached, evictable) at the end; cached pages are evicted,
oldest first, when new requests need room."""

import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.generation import Engine
from tfx.generation.pages import PageAllocator
from tfx.generation.prefix_cache import PrefixCache, page_keys
from tfx.models import Decoder, DecoderConfig

VOCAB, PAGE = 50, 4


@pytest.fixture(scope="module")
def model():
    config = DecoderConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4,
                           attention={"num_kv_heads": 2}, d_ff=64, max_len=64)
    return Decoder(config, rngs=nnx.Rngs(0))


def _alone(model, prompt, new):
    return np.asarray(tfx.generate(model, [prompt], max_new_tokens=new,
                                   temperature=0.0))[0, len(prompt):]


def test_shared_prefixes_are_read_once_and_give_the_same_tokens(model):
    rng = np.random.default_rng(0)
    system = rng.integers(0, VOCAB, 13).tolist()  # three full pages and one token
    prompts = [system + rng.integers(0, VOCAB, n).tolist() for n in (2, 5, 0, 9)]
    engine = Engine(model, num_pages=40, page_size=PAGE, max_batch=2, chunk=8,
                    prefix_cache=True)
    first = engine.generate(prompts[:1], max_new_tokens=6)[0]
    rest = engine.generate(prompts[1:], max_new_tokens=6)
    assert first.cached_tokens == 0
    # the last prompt is the system prompt alone: its last page is the one it must feed
    assert [r.cached_tokens for r in rest] == [12, 12, 12]
    for prompt, result in zip(prompts, [first, *rest], strict=True):
        np.testing.assert_array_equal(result.tokens, _alone(model, prompt, 6))
    assert engine.num_free_pages == 40 and engine.num_pending == 0
    assert engine.allocator.num_free < 40  # the shared pages stay cached


def test_cached_pages_are_evicted_when_the_pool_needs_them(model):
    rng = np.random.default_rng(1)
    engine = Engine(model, num_pages=8, page_size=PAGE, max_batch=1, chunk=8,
                    prefix_cache=True)
    prompts = [rng.integers(0, VOCAB, 17).tolist() for _ in range(4)]  # 4 shareable pages
    results = engine.generate(prompts, max_new_tokens=4)  # 5 pages each: evictions
    for prompt, result in zip(prompts, results, strict=True):
        np.testing.assert_array_equal(result.tokens, _alone(model, prompt, 4))
    again = engine.generate(prompts[-1:], max_new_tokens=4)[0]  # the newest stayed cached
    assert again.cached_tokens == 16
    np.testing.assert_array_equal(again.tokens, results[-1].tokens)
    assert engine.num_free_pages == 8


def test_a_cancelled_request_leaves_its_shared_pages_cached(model):
    engine = Engine(model, num_pages=12, page_size=PAGE, max_batch=2, chunk=4,
                    prefix_cache=True)
    prompt = list(range(10))
    request = engine.submit(prompt, max_new_tokens=20)
    for _ in range(3):  # the prompt read (2 full pages shared), a token made
        engine.step()
    assert engine.cancel(request) and engine.num_free_pages == 12
    result = engine.generate([prompt], max_new_tokens=5)[0]
    assert result.cached_tokens == 8
    np.testing.assert_array_equal(result.tokens, _alone(model, prompt, 5))


def test_keys_depend_on_the_variant_and_every_token_before():
    prompt = np.arange(13, dtype=np.int32)
    keys = page_keys(prompt, 0, PAGE)
    assert len(keys) == 3 and len(page_keys(prompt[:12], 0, PAGE)) == 2
    assert page_keys(prompt, 1, PAGE)[0] != keys[0]
    changed = prompt.copy()
    changed[0] = 7
    assert all(a != b for a, b in zip(page_keys(changed, 0, PAGE), keys, strict=True))


def test_a_disabled_cache_shares_nothing():
    cache = PrefixCache(PageAllocator(6), enabled=False)
    keys = page_keys(np.arange(9, dtype=np.int32), 0, PAGE)
    pages, shared = cache.admit(keys, 3)
    cache.register(keys, pages, 9, PAGE)
    cache.release(pages)
    assert shared == 0 and cache.admit(keys, 3)[1] == 0 and cache.allocator.num_free == 3
