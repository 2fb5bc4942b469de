"""tfx.generation.Engine's request handling: results kept by request id until taken,
cancellation that frees pages at once, top-k / top-p per request, the chosen tokens'
log-probabilities, and weight variants checked at submit."""

import jax
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.generation import Engine
from tfx.models import Decoder, DecoderConfig

VOCAB = 50


@pytest.fixture(scope="module")
def model():
    config = DecoderConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4,
                           attention={"num_kv_heads": 2}, d_ff=64, max_len=48)
    return Decoder(config, rngs=nnx.Rngs(0))


def _engine(model, **changes):
    return Engine(model, **{"num_pages": 12, "page_size": 4, "max_batch": 3, "chunk": 8,
                            **changes})


def _alone(model, prompt, new):
    return np.asarray(tfx.generate(model, [prompt], max_new_tokens=new,
                                   temperature=0.0))[0, len(prompt):]


def _log_softmax_along(model, prompt, tokens):
    """log_softmax of the model's logits after each prefix of prompt + tokens (no cache):
    float32 [len(tokens), vocab]."""
    ids = np.asarray([*prompt, *tokens], np.int32)[None]
    logits = np.asarray(model(ids), np.float64)[0, len(prompt) - 1:-1]
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                           keepdims=True)) - logits.max(-1, keepdims=True)


def test_results_are_kept_by_id_until_taken(model):
    engine = _engine(model)
    first = engine.submit([1, 2, 3], max_new_tokens=2)
    second = engine.submit([4, 5], max_new_tokens=6)
    finished = []
    while not finished:
        finished = engine.step()
    assert [r.request_id for r in finished] == [first]
    with pytest.raises(ValueError, match="no result to take"):
        engine.pop_result(second)  # still running
    assert 0 < len(engine.tokens_so_far(second)[0]) < 6
    assert [r.request_id for r in engine.run()] == [first, second]  # the stepped one included
    assert engine.run() == []  # taken
    with pytest.raises(ValueError, match="no result to take"):
        engine.pop_result(first)


def test_cancelled_requests_free_their_pages_and_leave_the_others_alone(model):
    engine = _engine(model, num_pages=8)  # keep: 3 pages, running: 4, waiting: 6
    keep = engine.submit([1, 2, 3, 4, 5], max_new_tokens=7)
    running = engine.submit(list(range(9)), max_new_tokens=8)
    waiting = engine.submit([7, 8], max_new_tokens=20)
    engine.step()
    engine.step()
    free = engine.allocator.num_free
    assert engine.cancel(running) and engine.allocator.num_free == free + 4
    assert engine.cancel(waiting) and not engine.cancel(waiting)
    with pytest.raises(ValueError, match="not waiting or running"):
        engine.tokens_so_far(running)
    results = engine.run()
    assert [r.request_id for r in results] == [keep]
    np.testing.assert_array_equal(results[0].tokens, _alone(model, [1, 2, 3, 4, 5], 7))
    assert engine.allocator.num_free == 8 and engine.num_pending == 0


def test_logprobs_are_the_models_log_softmax_at_the_chosen_tokens(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # longer than the chunk: two prefill steps
    result = _engine(model).generate([prompt], max_new_tokens=6, temperature=0.7,
                                     rng=jax.random.key(0))[0]
    reference = _log_softmax_along(model, prompt, result.tokens)
    np.testing.assert_allclose(result.logprobs,
                               reference[np.arange(6), result.tokens], atol=1e-4)


@pytest.mark.parametrize("top_k, top_p", [(3, None), (None, 0.5), (4, 0.6)])
def test_sampled_tokens_stay_within_top_k_and_the_nucleus(model, top_k, top_p):
    engine = _engine(model, max_batch=4)
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10]]
    results = engine.generate(prompts, max_new_tokens=10, temperature=5.0, top_k=top_k,
                              top_p=top_p, rng=jax.random.key(1))
    for prompt, result in zip(prompts, results, strict=True):
        logprobs = _log_softmax_along(model, prompt, result.tokens)
        scaled = logprobs / 5.0  # the tempered distribution, up to a constant per row
        probs = np.exp(scaled - scaled.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        order = np.argsort(-probs, axis=-1)
        rank = np.argmax(order == result.tokens[:, None], axis=-1)
        if top_k is not None:
            assert np.all(rank < top_k), rank
        if top_p is not None:  # tokens before it in the order hold less than top_p
            before = np.take_along_axis(np.cumsum(np.take_along_axis(probs, order, -1), -1)
                                        - np.take_along_axis(probs, order, -1), rank[:, None],
                                        -1)[:, 0]
            assert np.all(before < top_p + 1e-5), before
    # the filters matter: unfiltered at this temperature leaves the top-3 somewhere
    free = engine.generate(prompts, max_new_tokens=10, temperature=5.0, rng=jax.random.key(1))
    ranks = [np.argmax(np.argsort(-_log_softmax_along(model, p, r.tokens), -1)
                       == r.tokens[:, None], -1) for p, r in zip(prompts, free, strict=True)]
    assert max(int(rank.max()) for rank in ranks) >= 3


def test_top_k_of_one_is_greedy(model):
    result = _engine(model).generate([[5, 6, 7]], max_new_tokens=8, temperature=1.5, top_k=1,
                                     rng=jax.random.key(2))[0]
    np.testing.assert_array_equal(result.tokens, _alone(model, [5, 6, 7], 8))


@pytest.mark.parametrize("settings, message", [
    ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"variant": 1}, r"variant must be an int in \[0, 1\)"), ({"variant": -1}, "variant")])
def test_bad_settings_are_refused_at_submit(model, settings, message):
    engine = _engine(model)
    with pytest.raises(ValueError, match=message):
        engine.submit([1, 2], max_new_tokens=2, **settings)
    assert engine.num_pending == 0


@pytest.mark.parametrize("prefill_rows", [0, 4])
def test_prefill_rows_must_fit_the_batch(model, prefill_rows):
    with pytest.raises(ValueError, match="prefill_rows"):
        _engine(model, prefill_rows=prefill_rows)
