"""tfx.generate: greedy output equals argmax decoding by full recomputation, padding and batching
do not change tokens, EOS stops rows, one compilation per prompt bucket, bad input fails early."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.generation import bucket_length
from tfx.generation.generate import _generate
from tfx.models import Decoder, DecoderConfig, EncoderDecoder, EncoderDecoderConfig

VOCAB = 50


@pytest.fixture(scope="module")
def decoder():
    config = DecoderConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4,
                           attention={"num_kv_heads": 2, "sliding_window": 6}, d_ff=64,
                           max_len=64, position="rope")
    return Decoder(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def seq2seq():
    config = EncoderDecoderConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4,
                                  d_ff=64, max_len=64, position="t5")
    return EncoderDecoder(config, rngs=nnx.Rngs(0))


def _prompts(batch=3, length=9):
    return np.random.default_rng(length).integers(0, VOCAB, (batch, length))


def _greedy_by_recomputation(step_logits, ids, new):
    """Reference: run the whole sequence again for every new token and take the argmax.

    The sequence is zero-padded on the right to its final length, which a causal model's
    position `t` does not see (tests/models/test_models.py checks causality): every step has
    one shape, so its eager ops compile once rather than once per length."""
    ids = np.asarray(ids)
    batch, length = ids.shape
    ids = np.concatenate([ids, np.zeros((batch, new), ids.dtype)], axis=1)
    for t in range(length, length + new):
        ids[:, t] = np.asarray(jnp.argmax(step_logits(jnp.asarray(ids))[:, t - 1], axis=-1))
    return ids


def test_greedy_equals_recomputation_past_the_window(decoder):
    prompts = _prompts()
    out = tfx.generate(decoder, prompts, max_new_tokens=12, temperature=0.0)
    assert out.dtype == jnp.int32 and out.shape == (3, 9 + 12)
    np.testing.assert_array_equal(out, _greedy_by_recomputation(decoder, prompts, 12))


def test_encoder_decoder_greedy_equals_recomputation(seq2seq):
    source = _prompts()
    out = tfx.generate(seq2seq, source, max_new_tokens=6, temperature=0.0)
    encoded = seq2seq.encode(jnp.asarray(source))
    start = np.zeros((3, 1), np.int64)  # decoder_start_token_id
    expected = _greedy_by_recomputation(lambda ids: seq2seq.decode(ids, encoded), start, 6)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("side", ["left", "right"])
def test_batched_prompts_of_different_lengths_equal_one_at_a_time(decoder, side):
    prompts, lengths = _prompts(), [9, 4, 6]
    mask = np.zeros_like(prompts)
    for row, length in enumerate(lengths):
        if side == "left":
            mask[row, 9 - length:] = 1
        else:
            mask[row, :length] = 1
    batched = tfx.generate(decoder, prompts, max_new_tokens=8, temperature=0.0,
                           attention_mask=mask)
    np.testing.assert_array_equal(batched[:, :9], prompts)  # the prompt comes back as given
    for row in range(3):
        alone = tfx.generate(decoder, prompts[row:row + 1, mask[row].astype(bool)],
                             max_new_tokens=8, temperature=0.0)
        np.testing.assert_array_equal(batched[row, 9:], alone[0, -8:])


def test_eos_stops_each_row_and_pads(decoder):
    prompts = _prompts()
    free = np.asarray(tfx.generate(decoder, prompts, max_new_tokens=10, temperature=0.0))[:, 9:]
    eos = int(free[0, 2])  # row 0 emits it at step 2 (perhaps earlier too)
    first = int(np.argmax(free[0] == eos))
    out = np.asarray(tfx.generate(decoder, prompts, max_new_tokens=10, temperature=0.0,
                                  eos_token_id=eos, pad_token_id=VOCAB - 1))[:, 9:]
    for row in range(3):
        hits = np.flatnonzero(free[row] == eos)
        stop = hits[0] + 1 if hits.size else 10
        np.testing.assert_array_equal(out[row, :stop], free[row, :stop])
        assert (out[row, stop:] == VOCAB - 1).all()
    assert (out[0, first + 1:] == VOCAB - 1).all()


def test_sampling_is_reproducible_and_varies_with_the_key(decoder):
    prompts = _prompts()
    kwargs = dict(max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9)
    a = tfx.generate(decoder, prompts, rng=jax.random.key(0), **kwargs)
    b = tfx.generate(decoder, prompts, rng=jax.random.key(0), **kwargs)
    c = tfx.generate(decoder, prompts, rng=jax.random.key(1), **kwargs)
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()
    # top_k=1 leaves one candidate: sampling is greedy.
    greedy = tfx.generate(decoder, prompts, max_new_tokens=10, temperature=0.0)
    np.testing.assert_array_equal(
        tfx.generate(decoder, prompts, max_new_tokens=10, temperature=1.0, top_k=1,
                     rng=jax.random.key(2)), greedy)


def test_one_compilation_per_prompt_bucket(decoder):
    """Prompt lengths in one bucket, new sampling values and new prompts reuse the program; the
    decoding loop is inside it, so steps never compile."""
    compiles = []

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    kwargs = dict(max_new_tokens=7, rng=jax.random.key(0))
    tfx.generate(decoder, _prompts(length=17), temperature=0.5, top_p=0.9, **kwargs)
    size = _generate._cache_size()
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        for length, temperature, top_p in [(20, 0.7, 0.5), (32, 1.3, 1.0), (25, 0.0, 0.9)]:
            tfx.generate(decoder, _prompts(length=length), temperature=temperature, top_p=top_p,
                         **kwargs).block_until_ready()
        assert not compiles
        assert _generate._cache_size() == size
        tfx.generate(decoder, _prompts(length=33), temperature=0.5, top_p=0.9, **kwargs)
        assert _generate._cache_size() == size + 1  # the next bucket: one new program
    finally:
        jax._src.monitoring.unregister_event_duration_listener(count)


def test_bucket_length():
    assert [bucket_length(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
    assert bucket_length(40, limit=50) == 50  # capped by what fits the model
    assert bucket_length(60, limit=50) == 60  # never shorter than the prompt


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=60), "max_len"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(eos_token_id=VOCAB), "eos_token_id"),
    (dict(attention_mask=np.ones((3, 4))), "attention_mask"),
    (dict(attention_mask=np.zeros((3, 9))), "without any real token"),
])
def test_bad_input_fails_before_compiling(decoder, kwargs, match):
    size = _generate._cache_size()
    arguments = dict(max_new_tokens=4, temperature=0.0) | kwargs
    with pytest.raises(ValueError, match=match):
        tfx.generate(decoder, _prompts(), **arguments)
    assert _generate._cache_size() == size


def test_bad_model_and_prompt():
    with pytest.raises(TypeError, match="Decoder or EncoderDecoder"):
        tfx.generate(object(), _prompts(), max_new_tokens=2, temperature=0.0)
    config = DecoderConfig(vocab_size=VOCAB, d_model=16, num_layers=1, num_heads=2, d_ff=16,
                           max_len=8)
    with pytest.raises(ValueError, match="max_len"):  # prompt alone longer than max_len
        tfx.generate(Decoder(config, rngs=nnx.Rngs(0)), _prompts(), max_new_tokens=1,
                     temperature=0.0)
    with pytest.raises(ValueError, match="input_ids"):
        tfx.generate(Decoder(config, rngs=nnx.Rngs(0)), np.zeros(4, int), max_new_tokens=1,
                     temperature=0.0)


@pytest.mark.parametrize("position", ["xl", "learned"])
def test_scanned_layers_and_transformer_xl_memory(position):
    """Stacked (nnx.scan) layers run inside the decoding loop; Transformer-XL decodes from its
    segment memory, with right-padded prompts too (generate left-aligns them)."""
    config = DecoderConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                           max_len=64, position=position, compute={"scan_layers": True})
    model = Decoder(config, rngs=nnx.Rngs(0))
    prompts = _prompts(batch=2)
    mask = np.ones_like(prompts)
    mask[1, 6:] = 0
    out = tfx.generate(model, prompts, max_new_tokens=6, temperature=0.0, attention_mask=mask)
    np.testing.assert_array_equal(out[0], _greedy_by_recomputation(model, prompts[:1], 6)[0])
    np.testing.assert_array_equal(out[1, 9:],
                                  _greedy_by_recomputation(model, prompts[1:, :6], 6)[0, 6:])
