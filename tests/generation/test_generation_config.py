"""A model's `GenerationConfig` gives `tfx.generate`, `tfx.beam_search` and
`tfx.speculative_generate` every argument a call leaves unset (explicit values win; no config:
greedy, no EOS); sampling without an rng draws with jax.random.key(0); the config survives
nnx.split / merge, nnx.jit and a cache resize; `tfx serve` stops where generate stops; decoding
under jit says to call it outside. Each is checked against the same call with the arguments
spelled out (transformers parity: tests/hf/test_generation_defaults.py)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.generation import GenerationConfig
from tfx.models import Decoder, DecoderConfig

VOCAB, NEW, PAD = 50, 8, 49
PROMPTS = np.random.default_rng(0).integers(1, VOCAB - 1, (3, 6))
SAMPLING = dict(temperature=0.7, top_k=5, top_p=0.9)


@pytest.fixture(scope="module")
def decoder():
    config = DecoderConfig(vocab_size=VOCAB, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                           max_len=32)
    return Decoder(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def greedy(decoder):
    """The greedy continuation, every argument spelled out: int32 [3, 6 + NEW]."""
    return np.asarray(tfx.generate(decoder, PROMPTS, max_new_tokens=NEW, temperature=0.0,
                                   eos_token_id=[]))


@pytest.fixture(scope="module")
def eos(greedy):
    """An id that row 0 first produces at its third new token and row 1 never before that, so
    that row 0 stops early and another row goes on."""
    token = int(greedy[0, 6 + 2])
    assert token not in greedy[0, 6:8] and token not in greedy[1, 6:9], greedy
    return token


def _configured(model, **fields):
    """A copy of `model` (same parameters) that carries GenerationConfig(**fields)."""
    copy = nnx.merge(*nnx.split(model))
    copy.generation_config = GenerationConfig(**fields)
    return copy


def test_generate_takes_what_a_call_leaves_unset_from_the_config(decoder, greedy, eos):
    # No config: greedy (before: temperature 1.0, which needed an rng), no EOS.
    np.testing.assert_array_equal(tfx.generate(decoder, PROMPTS, max_new_tokens=NEW), greedy)
    model = _configured(decoder, eos_token_id=[VOCAB - 2, eos], pad_token_id=PAD,
                       max_new_tokens=NEW)
    expected = np.asarray(tfx.generate(decoder, PROMPTS, max_new_tokens=NEW, temperature=0.0,
                                       eos_token_id=[VOCAB - 2, eos], pad_token_id=PAD))
    assert (expected[0, 6 + 3:] == PAD).all() and (expected[1:, 6 + 3:] != PAD).any()
    np.testing.assert_array_equal(tfx.generate(model, PROMPTS), expected)
    # The caller's values win: no EOS at all.
    np.testing.assert_array_equal(tfx.generate(model, PROMPTS, eos_token_id=[]), greedy)
    # A config's ids past the vocabulary are never produced (tiny checkpoints keep their
    # family's ids): transformers never stops at them, tfx drops them.
    beyond = _configured(decoder, eos_token_id=VOCAB + 5, pad_token_id=VOCAB)
    np.testing.assert_array_equal(tfx.generate(beyond, PROMPTS, max_new_tokens=NEW), greedy)


def test_a_sampling_config_samples_with_a_default_key(decoder, greedy):
    model = _configured(decoder, do_sample=True, **SAMPLING)
    expected = np.asarray(tfx.generate(decoder, PROMPTS, max_new_tokens=NEW,
                                       rng=jax.random.key(0), **SAMPLING))
    assert (expected != greedy).any()
    np.testing.assert_array_equal(tfx.generate(model, PROMPTS, max_new_tokens=NEW), expected)
    np.testing.assert_array_equal(
        tfx.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.0), greedy)
    # top_k=0 switches the config's top_k off, as in transformers.
    np.testing.assert_array_equal(
        tfx.generate(model, PROMPTS, max_new_tokens=NEW, top_k=0),
        tfx.generate(decoder, PROMPTS, max_new_tokens=NEW, temperature=0.7, top_p=0.9,
                     rng=jax.random.key(0)))


def test_max_new_tokens_comes_from_max_new_tokens_or_max_length(decoder, greedy):
    model = _configured(decoder, max_length=6 + NEW)  # prompt included, as in transformers
    np.testing.assert_array_equal(tfx.generate(model, PROMPTS), greedy)
    with pytest.raises(ValueError, match=r"max_new_tokens must be given .* neither"):
        tfx.generate(decoder, PROMPTS)
    with pytest.raises(ValueError, match=r"max_length \(6\) leaves no room after the 6"):
        tfx.generate(_configured(decoder, max_length=6), PROMPTS)


def test_beam_search_and_speculative_take_eos_from_the_config(decoder, eos):
    model = _configured(decoder, eos_token_id=eos, pad_token_id=PAD, max_new_tokens=NEW)
    np.testing.assert_array_equal(
        tfx.beam_search(model, PROMPTS, num_beams=2),
        tfx.beam_search(decoder, PROMPTS, num_beams=2, max_new_tokens=NEW, eos_token_id=eos,
                        pad_token_id=PAD))
    # Greedy speculative decoding gives generate's tokens.
    np.testing.assert_array_equal(
        tfx.speculative_generate(model, model, PROMPTS),
        tfx.generate(decoder, PROMPTS, max_new_tokens=NEW, temperature=0.0, eos_token_id=eos,
                     pad_token_id=PAD))


def test_decoding_under_jit_says_to_call_it_outside(decoder):
    """Before: TracerArrayConversionError, without a word on what to do."""
    calls = [lambda m, ids: tfx.generate(m, ids, max_new_tokens=2),
             lambda m, ids: tfx.beam_search(m, ids, num_beams=2, max_new_tokens=2),
             lambda m, ids: tfx.speculative_generate(m, m, ids, max_new_tokens=2)]
    for call in calls:
        with pytest.raises(TypeError, match=r"must be called outside jax\.jit / nnx\.jit"):
            nnx.jit(call)(decoder, jnp.asarray(PROMPTS))
    with pytest.raises(TypeError, match=r"tfx\.generate compiles its own decoding loop"):
        nnx.jit(lambda m: tfx.generate(m, PROMPTS, max_new_tokens=2))(decoder)


def test_the_config_survives_split_merge_jit_and_a_cache_resize(decoder):
    from tfx.train.sampling import with_cache_length

    model = _configured(decoder, eos_token_id=3)
    assert nnx.merge(*nnx.split(model)).generation_config == GenerationConfig(eos_token_id=3)
    assert int(nnx.jit(lambda m: jnp.int32(m.generation_config.eos_token_id[0]))(model)) == 3
    assert with_cache_length(model, 16, 16).generation_config == model.generation_config


def test_serve_stops_at_the_config_eos_else_the_tokenizer_eos(decoder):
    from tfx.serve.loading import _eos

    tokenizer = types.SimpleNamespace(eos_id=4)
    assert _eos(_configured(decoder, eos_token_id=[7, 9]), tokenizer) == (7, 9)
    assert _eos(decoder, tokenizer) == (4,)


def test_from_hf_fills_transformers_defaults_and_to_hf_writes_the_rest():
    config = GenerationConfig.from_hf({"eos_token_id": 2, "do_sample": True, "temperature": 0.6,
                                       "top_p": 0.9, "pad_token_id": None,
                                       "transformers_version": "5.0"}, "generation_config.json")
    assert config == GenerationConfig(eos_token_id=(2,), do_sample=True, temperature=0.6,
                                      top_k=50, top_p=0.9)
    assert config.to_hf() == {"eos_token_id": 2, "do_sample": True, "temperature": 0.6,
                              "top_p": 0.9}
    plain = GenerationConfig(eos_token_id=[1, 2], max_new_tokens=5)  # tfx's: no top_k
    assert plain.to_hf() == {"eos_token_id": [1, 2], "top_k": 0, "max_new_tokens": 5}
    for each in (config, plain):
        assert GenerationConfig.from_hf(each.to_hf(), "") == each


@pytest.mark.parametrize(("fields", "match"), [
    ({"eos_token_id": "2"}, "eos_token_id must be a token id or a list of them"),
    ({"eos_token_id": [2, -1]}, "eos_token_id must be an int >= 0, got -1"),
    ({"do_sample": "yes"}, "do_sample must be true or false, got 'yes'"),
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"top_p": 1.5}, "top_p must be a finite number in (0, 1]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1, got 0"),
    ({"early_stopping": "sometimes"}, "early_stopping must be true, false or 'never'"),
])
def test_from_hf_names_the_file_and_the_field(fields, match):
    with pytest.raises(ValueError) as error:
        GenerationConfig.from_hf(fields, "gen.json")
    assert str(error.value).startswith(f"gen.json: generation_config.{match}")


def test_a_foreign_generation_config_attribute_is_refused(decoder):
    copy = nnx.merge(*nnx.split(decoder))
    copy.generation_config = {"eos_token_id": 2}
    with pytest.raises(TypeError, match=r"must be a tfx\.generation\.GenerationConfig"):
        tfx.generate(copy, PROMPTS, max_new_tokens=2)
