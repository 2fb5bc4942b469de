"""tfx.generation.Engine serving a hybrid decoder (Gated DeltaNet linear layers beside
attention layers): each greedy request gets the tokens of `tfx.generate` run on it alone,
through chunked prefill (right-padded chunks, prefill rows packed out of order), rows reused by
later requests (their recurrent states emptied) and EOS; prefix caching is refused; the pools
and the fixed-size states are counted apart."""

import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.generation import Engine
from tfx.models import Decoder, DecoderConfig

VOCAB = 50
MAX_NEW = 8
# Prompts longer than the chunk (8) and not a multiple of it, of one token, and between.
REQUESTS = [(19, 5), (3, 8), (1, 4), (11, 2), (6, 7), (14, 3)]


@pytest.fixture(scope="module")
def model():
    config = DecoderConfig(
        vocab_size=VOCAB, d_model=32, num_layers=3, num_heads=4, d_ff=64, max_len=48,
        position="rope", norm={"kind": "rms"}, use_bias=False,
        attention={"layer_types": ("linear", "full", "linear"), "num_kv_heads": 2},
        linear={"heads": 4, "key_heads": 2, "key_dim": 8, "value_dim": 8, "chunk_size": 4})
    model = Decoder(config, rngs=nnx.Rngs(0))
    model.eval()
    return model


def _alone(model, prompt, new, eos=None):
    """Reference: tfx.generate on this request alone (MAX_NEW tokens, one program per prompt
    bucket), cut to `new` and after its first EOS."""
    out = np.asarray(tfx.generate(model, [prompt], max_new_tokens=MAX_NEW, temperature=0.0,
                                  eos_token_id=eos))[0, len(prompt):len(prompt) + new]
    ends = np.flatnonzero(out == eos) if eos is not None else []
    return out[:ends[0] + 1] if len(ends) else out


@pytest.mark.parametrize("prefill_rows", [1, 2])
def test_greedy_tokens_equal_generate_alone(model, prefill_rows):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n, _ in REQUESTS]
    news = [new for _, new in REQUESTS]
    expected = [_alone(model, p, n) for p, n in zip(prompts, news, strict=True)]
    eos = [None] * len(prompts)
    eos[1] = int(expected[1][2])  # one request ends on EOS, the third token it emits
    expected[1] = _alone(model, prompts[1], news[1], eos[1])
    engine = Engine(model, num_pages=24, page_size=4, max_batch=3, chunk=8,
                    prefill_rows=prefill_rows)
    ids = {}
    for i in rng.permutation(len(prompts)):  # submitted between steps, in a random order
        ids[engine.submit(prompts[i], max_new_tokens=news[i], eos_token_id=eos[i])] = i
        engine.step()
    for result in engine.run():
        i = ids[result.request_id]
        np.testing.assert_array_equal(result.tokens, expected[i], err_msg=f"request {i}")
    assert engine.num_programs == 2 and engine.allocator.num_free == 24


def test_prefix_cache_is_refused_by_name(model):
    with pytest.raises(ValueError, match=r"prefix_cache must be False .* linear-attention"):
        Engine(model, num_pages=8, prefix_cache=True)


def test_pool_and_state_bytes_are_counted_apart(model):
    engine = Engine(model, num_pages=10, page_size=4, max_batch=3)
    # one attention layer: keys and values [2 heads, 10 pages, 4 tokens, 8 dims] float32
    assert engine.pool_bytes == 2 * 2 * 10 * 4 * 8 * 4
    # two linear layers, per row: the conv state [3 taps, 2·2·8 + 4·8 channels] and the delta
    # state [4 heads, 8, 8], float32
    assert engine.state_bytes == 2 * 3 * (3 * 64 + 4 * 8 * 8) * 4
