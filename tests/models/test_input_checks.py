"""Models refuse values out of range (ids, token types, learned positions, KV-cache room) and
empty inputs with a ValueError that names the argument, the value and the range; in checked
mode (`tfx.models.checked`) the same checks run under jit, and outside it jit pays nothing."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import (
    Decoder,
    DecoderConfig,
    Encoder,
    EncoderConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
    checked,
    checks,
)
from tfx.peft import SoftPrompt

VOCAB, MAX_LEN = 11, 8
TINY = dict(vocab_size=VOCAB, d_model=8, num_layers=1, num_heads=2, d_ff=16, max_len=MAX_LEN)
VOCAB_RANGE = f"must be in [0, {VOCAB}) (the vocabulary, vocab_size = {VOCAB})"


@pytest.fixture(scope="module")
def decoder():
    return Decoder(DecoderConfig(**TINY), rngs=nnx.Rngs(0))  # learned positions


@pytest.fixture(scope="module")
def encoder():
    return Encoder(EncoderConfig(**TINY, type_vocab_size=2), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def seq2seq():
    return EncoderDecoder(EncoderDecoderConfig(**TINY, position="learned"), rngs=nnx.Rngs(0))


def _ids(*values):
    return jnp.asarray([values], jnp.int32)


def _calls(decoder, encoder, seq2seq):
    """(model call, name of its ids argument) for every entry point that takes token ids."""
    ok = _ids(1, 2)
    return [
        (lambda ids: decoder(ids), "input_ids"),
        (lambda ids: encoder(ids), "input_ids"),
        (lambda ids: seq2seq(ids, decoder_input_ids=ok), "input_ids"),
        (lambda ids: seq2seq(ok, decoder_input_ids=ids), "decoder_input_ids"),
    ]


@pytest.mark.parametrize("bad, dtype", [(VOCAB, jnp.int32), (-1, jnp.int32), (255, jnp.uint8)])
def test_ids_out_of_the_vocabulary_are_refused(decoder, encoder, seq2seq, bad, dtype):
    """Before: id >= vocab gave NaN logits (jnp.take fills), -1 wrapped to the last row."""
    ids = jnp.asarray([[1, 2, bad]], dtype)
    for call, name in _calls(decoder, encoder, seq2seq):
        message = f"{name} {VOCAB_RANGE}, got {bad} at {name}[0, 2]"
        with pytest.raises(ValueError, match=re.escape(message)):
            call(ids)


def test_token_types_out_of_range_and_of_another_shape_are_refused(encoder):
    with pytest.raises(ValueError, match=re.escape(
            "token_type_ids must be in [0, 2) (the token types, type_vocab_size = 2), got 2 at "
            "token_type_ids[0, 1]")):
        encoder(_ids(1, 2), token_type_ids=_ids(0, 2))
    with pytest.raises(ValueError, match=r"token_type_ids must have the shape of input_ids"):
        encoder(jnp.ones((2, 2), jnp.int32), token_type_ids=_ids(0, 1))


@pytest.mark.parametrize("bad", [MAX_LEN, -1])
def test_position_ids_outside_the_learned_table_are_refused(decoder, encoder, bad):
    table = f"the learned position table, config.max_len = {MAX_LEN}"
    for model in (decoder, encoder):
        with pytest.raises(ValueError, match=re.escape(
                f"position_ids must be in [0, {MAX_LEN}) ({table}), got {bad} at "
                "position_ids[0, 1]")):
            model(_ids(1, 2), position_ids=_ids(0, bad))


def test_position_ids_leave_room_for_a_soft_prompt():
    model = SoftPrompt(num_tokens=3).attach(Decoder(DecoderConfig(**TINY), rngs=nnx.Rngs(0)),
                                            rngs=nnx.Rngs(1))
    chex.assert_shape(model(_ids(1, 2), position_ids=_ids(0, MAX_LEN - 4)), (1, 2, VOCAB))
    with pytest.raises(ValueError, match=re.escape(
            f"position_ids must be in [0, {MAX_LEN - 3}) (the learned position table, "
            f"config.max_len - 3 leading vectors = {MAX_LEN - 3}), got {MAX_LEN - 3}")):
        model(_ids(1, 2), position_ids=_ids(0, MAX_LEN - 3))


def test_a_linear_cache_refuses_tokens_past_its_end(decoder, seq2seq):
    """Before: the writes past the end were dropped and the logits silently wrong."""
    cache = decoder.init_cache(2, 5)
    mask = jnp.asarray([[1, 1, 1], [1, 0, 0]], bool)  # padding takes no slot
    _, cache = decoder(jnp.ones((2, 3), jnp.int32), attention_mask=mask, cache=cache)
    _, full = decoder(jnp.ones((2, 2), jnp.int32), cache=cache)  # row 0 exactly fills it
    with pytest.raises(ValueError, match=re.escape(
            "input_ids does not fit: row 0 has 5 tokens cached and feeds 1 more, beyond the 5 "
            "that the KV cache holds (init_cache max_len)")):
        decoder(jnp.ones((2, 1), jnp.int32), cache=full)
    state = seq2seq.init_cache(seq2seq.encode(_ids(1, 2)), 2)
    _, state = seq2seq.decode(_ids(1, 2), cache=state)
    with pytest.raises(ValueError, match="decoder_input_ids does not fit: row 0 has 2 tokens"):
        seq2seq.decode(_ids(3), cache=state)


def test_a_cache_larger_than_the_learned_table_stops_at_the_table(decoder):
    from tfx.ops.kv_cache import init_cache

    cache = init_cache(num_layers=1, batch=1, max_len=MAX_LEN + 4, num_kv_heads=2, head_dim=4)
    _, cache = decoder(jnp.ones((1, MAX_LEN - 1), jnp.int32), cache=cache)
    with pytest.raises(ValueError, match=re.escape(
            f"beyond the {MAX_LEN} that the learned position table holds (config.max_len)")):
        decoder(jnp.ones((1, 2), jnp.int32), cache=cache)


def test_a_ring_buffer_has_no_limit():
    config = DecoderConfig(**TINY, position="rope", attention={"sliding_window": 3})
    model = Decoder(config, rngs=nnx.Rngs(0))
    cache = model.init_cache(1, MAX_LEN)  # a ring of 3 slots
    for _ in range(5):  # 10 tokens: past the 3 slots and past max_len
        logits, cache = model(jnp.ones((1, 2), jnp.int32), cache=cache)
    assert bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_empty_inputs_are_refused(decoder, encoder, seq2seq, shape):
    """Before: jax's "zero-size array to reduction operation" from deep inside the layers
    (or, for some families, an empty result)."""
    for call, name in _calls(decoder, encoder, seq2seq):
        with pytest.raises(ValueError, match=re.escape(
                f"{name} must hold at least one sequence of at least one token, got shape "
                f"{shape}")):
            call(jnp.zeros(shape, jnp.int32))


def _every_argument(decoder, encoder, seq2seq):
    """(model call, its array arguments) for every family: ids, masks, token types,
    positions."""
    ids, ones = [[1, 2, 3]], [[1, 1, 0]]
    return [
        (decoder, dict(input_ids=ids, attention_mask=ones, position_ids=[[0, 1, 2]],
                       segment_ids=[[0, 0, 1]])),
        (encoder, dict(input_ids=ids, attention_mask=ones, token_type_ids=[[0, 1, 1]],
                       position_ids=[[0, 1, 2]])),
        (seq2seq, dict(input_ids=ids, attention_mask=ones, decoder_input_ids=[[1, 2]],
                       decoder_attention_mask=[[1, 0]])),
    ]


def test_numpy_arrays_and_nested_lists_are_taken_alike(decoder, encoder, seq2seq):
    """Before: a list raised TypeError for input_ids, AttributeError for the masks, while
    tfx.generate took lists."""
    for model, arguments in _every_argument(decoder, encoder, seq2seq):
        ids = arguments.pop("input_ids")
        expected = model(jnp.asarray(ids), **{k: jnp.asarray(v) for k, v in arguments.items()})
        chex.assert_trees_all_close(
            model(np.asarray(ids), **{k: np.asarray(v) for k, v in arguments.items()}), expected)
        chex.assert_trees_all_close(model(ids, **arguments), expected)
    # Under jit a list is a structure of traced ints: taken the same way as the array (the
    # same compiled maths, so equal; eager ops round apart from a fused program), and checked
    # in checked mode.
    forward = jax.jit(lambda ids: decoder(ids))
    chex.assert_trees_all_equal(forward([[1, 2, 3]]), forward(_ids(1, 2, 3)))
    with pytest.raises(ValueError, match=re.escape(f"input_ids {VOCAB_RANGE}, got {VOCAB}")):
        checked(lambda model, ids: model(ids))(decoder, [[1, VOCAB]])


@pytest.mark.parametrize("argument", ["input_ids", "attention_mask", "token_type_ids",
                                      "position_ids"])
def test_ragged_lists_and_other_types_are_refused(encoder, argument):
    arguments = dict(input_ids=[[1, 2]], attention_mask=[[1, 1]], token_type_ids=[[0, 1]],
                     position_ids=[[0, 1]])
    with pytest.raises(ValueError, match=re.escape(argument) + r" \(.*\): a nested list must "
                       "hold numbers in rows of one length, got a ragged or mixed list"):
        encoder(**{**arguments, argument: [[1, 2], [1]]})
    with pytest.raises(TypeError, match=f"{argument} must be a jax or numpy array"):
        encoder(**{**arguments, argument: "12"})


def test_masks_of_another_shape_are_refused(decoder, encoder, seq2seq):
    """Before: an error about a broadcast deep in attention, naming no argument (or a silent
    broadcast)."""
    message = "attention_mask must have the shape of input_ids (1, 3), got (1, 2)"
    for model in (decoder, encoder):
        with pytest.raises(ValueError, match=re.escape(message)):
            model(_ids(1, 2, 3), attention_mask=jnp.ones((1, 2)))
    with pytest.raises(ValueError, match=re.escape(
            "decoder_attention_mask must have the shape of decoder_input_ids (1, 2), got (1, 3)")):
        seq2seq(_ids(1), decoder_input_ids=_ids(1, 2), decoder_attention_mask=jnp.ones((1, 3)))


def test_sequences_longer_than_the_learned_table_are_refused(decoder, encoder, seq2seq):
    """Named by their argument, eagerly, under plain jit and in checked mode (a shape).
    Before: a message from the position table naming no argument."""
    long, ok = jnp.ones((1, MAX_LEN + 1), jnp.int32), _ids(1, 2)
    table = f"which exceeds the learned position table (config.max_len = {MAX_LEN})"
    calls = [(lambda ids: decoder(ids), "input_ids"), (lambda ids: encoder(ids), "input_ids"),
             (lambda ids: seq2seq(ids, decoder_input_ids=ok), "input_ids"),
             (lambda ids: seq2seq(ok, decoder_input_ids=ids), "decoder_input_ids")]
    for call, name in calls:
        message = re.escape(f"{name} has {MAX_LEN + 1} tokens, {table}")
        for run in (call, jax.jit(call), checked(call)):
            with pytest.raises(ValueError, match=message):
                run(long)
        assert bool(jnp.all(jnp.isfinite(call(jnp.ones((1, MAX_LEN), jnp.int32)))))  # fits


def test_a_soft_prompt_takes_room_from_the_sequence():
    model = SoftPrompt(num_tokens=3).attach(Decoder(DecoderConfig(**TINY), rngs=nnx.Rngs(0)),
                                            rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=re.escape(
            f"input_ids has {MAX_LEN - 2} tokens, which exceeds the learned position table "
            f"(config.max_len - 3 leading vectors = {MAX_LEN - 3})")):
        model(jnp.ones((1, MAX_LEN - 2), jnp.int32))


def test_other_positions_have_no_table_and_max_len_limits_nothing():
    """RoPE, ALiBi, T5, sinusoidal: config.max_len is informative (generate sizes its cache by
    it); a longer sequence is computed as given."""
    for position in ("rope", "alibi", "sinusoidal", "none"):
        model = Decoder(DecoderConfig(**{**TINY, "position": position}), rngs=nnx.Rngs(0))
        assert bool(jnp.all(jnp.isfinite(model(jnp.ones((1, 2 * MAX_LEN), jnp.int32)))))


# Checked mode: the same checks on traced values, through jax.experimental.checkify.

def test_checked_mode_raises_the_eager_message_under_jit(decoder, encoder):
    ids = _ids(1, VOCAB)
    with pytest.raises(ValueError) as eager:
        decoder(ids)
    run = checked(lambda model, ids: model(ids))
    with pytest.raises(ValueError, match=re.escape(str(eager.value))):
        run(decoder, ids)
    chex.assert_trees_all_close(run(decoder, _ids(1, 2)), decoder(_ids(1, 2)), atol=1e-6)
    with pytest.raises(ValueError, match="token_type_ids must be in"):
        checked(lambda model, ids, types: model(ids, token_type_ids=types))(
            encoder, _ids(1, 2), _ids(0, 2))


def test_checked_mode_runs_modules_that_update_their_state():
    """Dropout draws from the model's Rngs, whose count NNX updates in place."""
    model = Decoder(DecoderConfig(**TINY, dropout=0.5), rngs=nnx.Rngs(0))
    run = checked(lambda model, ids: model(ids))
    chex.assert_shape(run(model, _ids(1, 2)), (1, 2, VOCAB))
    with pytest.raises(ValueError, match=re.escape(f"input_ids {VOCAB_RANGE}, got -1")):
        run(model, _ids(1, -1))


def test_checked_mode_checks_the_cache_inside_a_loop(decoder):
    """The cache room is checked on every step of a lax.fori_loop, on traced positions."""
    def feed(model, cache, steps):
        def step(_, cache):
            return model(jnp.ones((1, 2), jnp.int32), cache=cache)[1]
        return jax.lax.fori_loop(0, steps, step, cache)

    run = checked(feed)
    run(decoder, decoder.init_cache(1, 6), 3)  # exactly full
    with pytest.raises(ValueError, match="input_ids does not fit: row 0 has 6 tokens cached"):
        run(decoder, decoder.init_cache(1, 6), 4)


def test_without_checked_mode_jit_compiles_as_if_there_were_no_checks(decoder, monkeypatch):
    """Traced values are not checked outside checked mode, and the program is unchanged."""
    def program():
        graphdef, state = nnx.split(decoder)
        cache = decoder.init_cache(1, 4)
        return jax.jit(lambda state, ids, cache: nnx.merge(graphdef, state)(ids, cache=cache)
                       ).lower(state, _ids(1, 2), cache).as_text()

    with_checks = program()
    monkeypatch.setattr(checks, "_require", lambda *args: None)
    assert program() == with_checks
    jax.jit(lambda ids: decoder(ids))(_ids(1, VOCAB))  # no error: nothing checks traced values


def test_checked_takes_the_plain_function():
    with pytest.raises(TypeError, match=re.escape("pass fn, not jax.jit(fn)")):
        checked(jax.jit(lambda x: x))
