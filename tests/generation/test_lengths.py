"""`return_lengths=True` of tfx.generate and tfx.beam_search: each row's length equals a naive
count (the columns before the new tokens, then the new tokens through the first EOS), the pad
id given is written after EOS (and only there), and the default return value is unchanged."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.models import Decoder, DecoderConfig, create

VOCAB, NEW, PROMPT = 50, 10, 9
PAD = VOCAB - 1


@pytest.fixture(scope="module")
def decoder():
    config = DecoderConfig(vocab_size=VOCAB, d_model=32, num_layers=1, num_heads=4, d_ff=64,
                           max_len=64, position="rope")
    return Decoder(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def seq2seq():
    """A tiny T5 with a scaled-up head (peaked distributions: no near-ties among beams)."""
    model = create("t5-small", rngs=nnx.Rngs(0), dropout=0.0, num_layers=1, d_model=32,
                   num_heads=4, d_ff=64, vocab_size=VOCAB, embeddings={"tie": False})
    model.head.kernel[...] = 6.0 * model.head.kernel[...]
    return model


def naive_lengths(rows: np.ndarray, head: int, eos: int) -> list[int]:
    """Walk each row after its first `head` columns and stop after the first eos."""
    out = []
    for row in rows:
        length = head
        for token in row[head:]:
            length += 1
            if token == eos:
                break
        out.append(length)
    return out


def prompts_and_mask(side: str):
    ids = np.random.default_rng(0).integers(0, VOCAB - 1, (3, PROMPT))
    mask = np.ones_like(ids)
    if side == "left":
        mask[1, :5] = mask[2, :2] = 0
    else:
        mask[1, 4:] = mask[2, 7:] = 0
    return ids, mask


def an_eos_that_stops_a_row_early(rows: np.ndarray, head: int) -> int:
    """A token that row 0 emits at its third new step (so that rows end at different steps)."""
    return int(rows[0, head + 2])


def check(tokens, lengths, head: int, eos: int):
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    assert lengths.dtype == np.int32 and lengths.shape == (tokens.shape[0],)
    np.testing.assert_array_equal(lengths, naive_lengths(tokens, head, eos))
    assert (lengths < tokens.shape[1]).any(), "no row ended: the test would not see padding"
    for row, length in zip(tokens, lengths, strict=True):
        assert (row[length:] == PAD).all()  # the pad id, distinct from EOS, after it
        assert PAD not in row[head:length]


@pytest.mark.parametrize("side", ["left", "right"])
def test_generate_lengths_of_a_padded_decoder_batch(decoder, side):
    ids, mask = prompts_and_mask(side)
    greedy = dict(max_new_tokens=NEW, temperature=0.0, attention_mask=mask)
    eos = an_eos_that_stops_a_row_early(np.asarray(tfx.generate(decoder, ids, **greedy)), PROMPT)
    plain = tfx.generate(decoder, ids, **greedy, eos_token_id=eos, pad_token_id=PAD)
    tokens, lengths = tfx.generate(decoder, ids, **greedy, eos_token_id=eos, pad_token_id=PAD,
                                   return_lengths=True)
    np.testing.assert_array_equal(tokens, plain)  # the default return value is the tokens
    check(tokens, lengths, PROMPT, eos)  # every prompt column counts, padding included


def test_generate_lengths_of_an_encoder_decoder(seq2seq):
    ids, mask = prompts_and_mask("right")
    greedy = dict(max_new_tokens=NEW, temperature=0.0, attention_mask=mask)
    eos = an_eos_that_stops_a_row_early(np.asarray(tfx.generate(seq2seq, ids, **greedy)), 1)
    tokens, lengths = tfx.generate(seq2seq, ids, **greedy, eos_token_id=eos, pad_token_id=PAD,
                                   return_lengths=True)
    check(tokens, lengths, 1, eos)  # the decoder start token, then the new tokens


def test_without_eos_every_row_is_full_and_the_default_pad_is_eos(decoder):
    ids, _ = prompts_and_mask("left")
    tokens, lengths = tfx.generate(decoder, ids, max_new_tokens=NEW, temperature=0.0,
                                   return_lengths=True)
    np.testing.assert_array_equal(lengths, [PROMPT + NEW] * 3)
    eos = an_eos_that_stops_a_row_early(np.asarray(tokens), PROMPT)
    tokens, lengths = tfx.generate(decoder, ids, max_new_tokens=NEW, temperature=0.0,
                                   eos_token_id=eos, return_lengths=True)
    row = np.asarray(tokens)[0]
    assert (row[int(lengths[0]):] == eos).all()  # no pad id given: EOS fills


def test_beam_search_lengths(seq2seq):
    ids, mask = prompts_and_mask("right")
    search = dict(num_beams=3, max_new_tokens=NEW, attention_mask=mask, num_return_sequences=2)
    eos = an_eos_that_stops_a_row_early(np.asarray(tfx.beam_search(seq2seq, ids, **search)), 1)
    search |= dict(eos_token_id=eos, pad_token_id=PAD)
    plain, scores = tfx.beam_search(seq2seq, ids, **search, return_scores=True)
    tokens, lengths = tfx.beam_search(seq2seq, ids, **search, return_lengths=True)
    np.testing.assert_array_equal(tokens, plain)
    check(tokens, lengths, 1, eos)
    both = tfx.beam_search(seq2seq, ids, **search, return_scores=True, return_lengths=True)
    for got, expected in zip(both, (plain, scores, lengths), strict=True):
        np.testing.assert_array_equal(got, expected)
    assert isinstance(tfx.beam_search(seq2seq, ids, **search), jnp.ndarray)


def test_the_default_pad_is_the_configs_pad_id(decoder, seq2seq):
    """Without pad_token_id the filler is the config's embeddings.pad_id (what tfx.hf.load
    reads from config.json's pad_token_id), not EOS."""
    ids, mask = prompts_and_mask("left")
    greedy = dict(max_new_tokens=NEW, temperature=0.0, attention_mask=mask)
    eos = an_eos_that_stops_a_row_early(np.asarray(tfx.generate(decoder, ids, **greedy)), PROMPT)
    padded = Decoder(decoder.config.replace(embeddings={"pad_id": PAD}), rngs=nnx.Rngs(0))
    tokens, lengths = tfx.generate(padded, ids, **greedy, eos_token_id=eos, return_lengths=True)
    check(tokens, lengths, PROMPT, eos)
    search = dict(num_beams=3, max_new_tokens=NEW, attention_mask=mask)
    eos = an_eos_that_stops_a_row_early(np.asarray(tfx.beam_search(seq2seq, ids, **search)), 1)
    config = seq2seq.config.replace(embeddings={"pad_id": PAD})
    t5 = nnx.merge(nnx.graphdef(type(seq2seq)(config, rngs=nnx.Rngs(0))), nnx.state(seq2seq))
    tokens, lengths = tfx.beam_search(t5, ids, **search, eos_token_id=eos, return_lengths=True)
    check(tokens, lengths, 1, eos)


@pytest.mark.parametrize(("pad_id", "error"), [(VOCAB, ValueError), (-1, ValueError),
                                               (True, TypeError)])
def test_a_pad_id_outside_the_vocabulary_is_refused(pad_id, error):
    with pytest.raises(error, match=r"embeddings\.pad_id"):
        DecoderConfig(vocab_size=VOCAB, d_model=32, num_layers=1, num_heads=4, d_ff=64,
                      embeddings={"pad_id": pad_id})
