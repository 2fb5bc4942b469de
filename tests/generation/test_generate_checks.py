"""generate and beam_search check their numbers and prompts on the host, before compiling:
NaN / inf / out-of-range sampling values and ids are refused by name, numpy scalars are taken
like Python numbers (same program, same tokens), and what does not fit the model is refused."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.generation.beam_search import _beam_search
from tfx.generation.generate import _generate
from tfx.models import Decoder, DecoderConfig, EncoderDecoder, EncoderDecoderConfig

VOCAB = 13
TINY = dict(vocab_size=VOCAB, d_model=8, num_layers=1, num_heads=2, d_ff=16, max_len=16)
PROMPTS = np.arange(6).reshape(2, 3) + 1
VOCAB_RANGE = f"input_ids must be in [0, {VOCAB}) (the vocabulary, vocab_size = {VOCAB})"


@pytest.fixture(scope="module")
def decoder():
    return Decoder(DecoderConfig(**TINY, position="rope"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def seq2seq():
    return EncoderDecoder(EncoderDecoderConfig(**TINY, position="learned"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0 (0 is greedy), "
                                     "got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature=np.float32(-1.0)), "temperature must be a finite number >= 0"),
    (dict(temperature=True), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p must be a finite number in (0, 1] or None, got nan"),
    (dict(top_p=np.float64(1.5)), "top_p must be a finite number in (0, 1]"),
    (dict(top_k=2.0), "top_k must be an int >= 0, got 2.0"),
    (dict(top_k=np.int64(-1)), "top_k must be an int >= 0"),
    (dict(max_new_tokens=np.float32(3)), "max_new_tokens must be an int >= 1"),
    (dict(input_ids=PROMPTS + VOCAB), f"{VOCAB_RANGE}, got {VOCAB + 1} at input_ids[0, 0]"),
    (dict(input_ids=-PROMPTS), f"{VOCAB_RANGE}, got -1 at input_ids[0, 0]"),
    (dict(input_ids=np.zeros((0, 3), int)), "input_ids must hold at least one sequence"),
    (dict(input_ids=np.zeros((2, 0), int)), "input_ids must hold at least one sequence"),
])
def test_generate_refuses_values_out_of_range_before_compiling(decoder, kwargs, match):
    """Before: NaN decoded greedily, inf sampled, an id >= vocab gave tokens from NaN logits,
    an empty batch failed in a numpy reduction."""
    arguments = dict(input_ids=PROMPTS, max_new_tokens=2, temperature=0.5,
                     rng=jax.random.key(0)) | kwargs
    size = _generate._cache_size()
    with pytest.raises(ValueError, match=re.escape(match)):
        tfx.generate(decoder, **arguments)
    assert _generate._cache_size() == size


def test_numpy_scalars_are_taken_like_python_numbers(decoder):
    """Before: np.float32(0.5) was refused as 'not a float'."""
    def run(temperature, top_k, top_p, new):
        return np.asarray(tfx.generate(decoder, PROMPTS, max_new_tokens=new,
                                       temperature=temperature, top_k=top_k, top_p=top_p,
                                       rng=jax.random.key(3)))

    expected = run(0.5, 3, 0.9, 4)
    size = _generate._cache_size()
    np.testing.assert_array_equal(run(np.float32(0.5), np.int64(3), np.float32(0.9),
                                      np.int64(4)), expected)
    assert _generate._cache_size() == size  # the same program


def test_prompt_that_does_not_fit_is_refused(decoder, seq2seq):
    with pytest.raises(ValueError, match=re.escape(
            "prompt (3 tokens) + max_new_tokens (14) exceeds the model's max_len (16)")):
        tfx.generate(decoder, PROMPTS, max_new_tokens=14, temperature=0.0)
    for search in (lambda ids: tfx.generate(seq2seq, ids, max_new_tokens=2, temperature=0.0),
                   lambda ids: tfx.beam_search(seq2seq, ids, num_beams=2, max_new_tokens=2)):
        with pytest.raises(ValueError, match=re.escape(
                "input_ids has 17 tokens, more than the model's learned position table holds "
                "(config.max_len = 16)")):
            search(np.ones((1, 17), int))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number, got nan"),
    (dict(length_penalty=float("-inf")), "length_penalty must be a finite number"),
    (dict(input_ids=PROMPTS * 3), f"{VOCAB_RANGE}, got {15} at input_ids[1, 1]"),
    (dict(input_ids=np.zeros((0, 3), int)), "input_ids must hold at least one sequence"),
])
def test_beam_search_refuses_values_out_of_range_before_compiling(seq2seq, kwargs, match):
    arguments = dict(input_ids=PROMPTS, num_beams=2, max_new_tokens=2) | kwargs
    size = _beam_search._cache_size()
    with pytest.raises(ValueError, match=re.escape(match)):
        tfx.beam_search(seq2seq, **arguments)
    assert _beam_search._cache_size() == size


def test_beam_search_takes_numpy_scalars(seq2seq):
    expected = np.asarray(tfx.beam_search(seq2seq, PROMPTS, num_beams=2, max_new_tokens=3,
                                          length_penalty=0.5, early_stopping=True))
    size = _beam_search._cache_size()
    out = tfx.beam_search(seq2seq, PROMPTS, num_beams=np.int64(2), max_new_tokens=np.int32(3),
                          length_penalty=np.float32(0.5), early_stopping=np.bool_(True))
    np.testing.assert_array_equal(out, expected)
    assert _beam_search._cache_size() == size
