"""Logits processors (tfx.ops.logits_processors, tfx.generation.processors) and stop sequences:
the maths against naive Python written out here, greedy `tfx.generate` against transformers'
generate token for token (tiny random GPT-2 and LLaMA with GQA, left-padded prompts), one
compiled program for any values, and the argument checks."""

import re

import jax
import numpy as np
import pytest
from decoding_cases import NEW, PAD, hf_generate, pairs_fixture, prompts
from flax import nnx

import tfx
from tfx.generation.generate import _generate
from tfx.models import Decoder, DecoderConfig
from tfx.ops import logits_processors as ops

P = 7  # prompt columns
pairs = pairs_fixture()
VOCAB = 7  # for the torch-free maths: a small vocabulary, so that tokens repeat


def _history(seed: int, vocab: int = VOCAB):
    """Random int [4, 20] tokens in [0, vocab) with left padding of 0..5 slots and slots
    >= 15 unfilled: (history, valid, pads, end)."""
    rng = np.random.default_rng(seed)
    history = rng.integers(0, vocab, size=(4, 20))
    pads, end = np.array([0, 2, 5, 3]), 15
    slots = np.arange(20)
    return history, (slots >= pads[:, None]) & (slots < end), pads, end


def _real(history, pads, end, row: int) -> list[int]:
    return history[row, pads[row]:end].tolist()


def test_repetition_penalty_against_naive():
    history, valid, pads, end = _history(0)
    logits = np.random.default_rng(1).normal(size=(4, VOCAB + 3)).astype(np.float32)
    out = np.asarray(ops.repetition_penalty(logits, history, valid, 1.7))
    for row in range(4):
        seen = set(_real(history, pads, end, row))
        for t in range(VOCAB + 3):
            x = logits[row, t]
            expected = (x * 1.7 if x < 0 else x / 1.7) if t in seen else x
            np.testing.assert_allclose(out[row, t], expected, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_against_naive(n):
    history, valid, pads, end = _history(n, vocab=3)  # 3 tokens repeat n-grams soon
    out = np.asarray(ops.no_repeat_ngram(np.zeros((4, VOCAB)), history, valid, end, n))
    assert np.isinf(out).any()
    for row in range(4):
        tokens = _real(history, pads, end, row)
        suffix = tuple(tokens[len(tokens) - n + 1:]) if n > 1 else ()
        banned = {tuple(tokens[i:i + n])[-1] for i in range(len(tokens) - n + 1)
                  if tuple(tokens[i:i + n - 1]) == suffix}
        assert set(np.flatnonzero(np.isinf(out[row]))) == banned


def test_sequences_against_naive():
    history, valid, pads, end = _history(4)
    last_two = [int(history[2, end - 2]), int(history[2, end - 1])]  # row 2 ends with them
    words = [[3], [2, 5], [4, 4, 1], [*last_two, 6], last_two]
    laid = np.array([[-1] * (3 - len(w)) + w for w in words])
    hit = np.asarray(ops.ends_with(history, valid, end, laid))
    out = np.asarray(ops.ban_sequences(np.zeros((4, VOCAB)), history, valid, end, laid))
    for row in range(4):
        tokens = _real(history, pads, end, row)
        assert hit[row].tolist() == [tokens[-len(w):] == list(w) for w in words]
        banned = {w[-1] for w in words if tokens[len(tokens) - len(w) + 1:] == list(w[:-1])}
        assert set(np.flatnonzero(np.isinf(out[row]))) == banned
    assert hit[2, 4] and np.isinf(out[2, 6])  # the cases that need a match do match


# Each setting from greedy's new tokens [3, NEW] without processors, so that it bites: the
# single and the two-token bad word are tokens greedy picks; min_new_tokens holds back an EOS
# that greedy produces at once.
SETTINGS = {
    "repetition_penalty": lambda new: dict(repetition_penalty=1.5),
    "no_repeat_ngram": lambda new: dict(no_repeat_ngram_size=2),
    "bad_words": lambda new: dict(bad_words_ids=[[int(new[0, 0])],
                                                 [int(new[1, 1]), int(new[1, 2])]]),
    "min_new_tokens": lambda new: dict(min_new_tokens=5, eos_token_id=int(new[2, 0])),
    "combined": lambda new: dict(repetition_penalty=1.3, no_repeat_ngram_size=3,
                                 bad_words_ids=[[int(new[0, 1])], [int(new[2, 0]), 5]],
                                 min_new_tokens=4, eos_token_id=int(new[1, 3])),
}
CASES = [("llama-gqa", name) for name in SETTINGS] + [("gpt2", "combined")]


@pytest.mark.parametrize(("case", "name"), CASES)
def test_greedy_matches_transformers(pairs, case, name):
    torch, _, pair = pairs
    hf_model, model = pair(case)
    ids, mask = prompts()
    setting = SETTINGS[name](hf_generate(torch, hf_model, ids, mask)[:, P:])
    expected = hf_generate(torch, hf_model, ids, mask, **setting)
    without = {k: v for k, v in setting.items() if k == "eos_token_id"}
    assert not np.array_equal(expected, hf_generate(torch, hf_model, ids, mask, **without))
    out = tfx.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, temperature=0.0,
                       pad_token_id=PAD, **setting)
    np.testing.assert_array_equal(np.asarray(out), expected)
    if case == "llama-gqa" and name == "combined":  # padding on the right counts for nothing
        right = np.array([row[m == 1].tolist() + [0] * (m == 0).sum() for row, m in
                          zip(ids, mask, strict=True)])
        out = tfx.generate(model, right, attention_mask=mask[:, ::-1], max_new_tokens=NEW,
                           temperature=0.0, pad_token_id=PAD, **setting)
        np.testing.assert_array_equal(np.asarray(out)[:, P:], expected[:, P:])


def _stop_on(transformers, torch, sequences):
    """A transformers StoppingCriteria: a row ends when its tokens end with a sequence."""
    class StopOn(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            for sequence in sequences:
                if input_ids.shape[1] >= len(sequence):
                    done |= (input_ids[:, -len(sequence):] == torch.tensor(sequence)).all(-1)
            return done

    return transformers.StoppingCriteriaList([StopOn()])


@pytest.mark.parametrize("case", ["gpt2", "llama-gqa"])
def test_stop_sequences_match_transformers(pairs, case):
    torch, transformers, pair = pairs
    hf_model, model = pair(case)
    ids, mask = prompts()
    new = hf_generate(torch, hf_model, ids, mask)[:, P:]
    stops = [[int(new[1, 3]), int(new[1, 4])], [int(new[2, 6])]]
    eos = 98  # an EOS makes transformers fill stopped rows with the pad token
    expected = hf_generate(torch, hf_model, ids, mask, eos_token_id=eos,
                           stopping_criteria=_stop_on(transformers, torch, stops))
    assert (expected[1:, -NEW + 7:] == PAD).all()  # rows 1 and 2 stopped, by 4 and 6 tokens
    out, lengths = tfx.generate(model, ids, attention_mask=mask, max_new_tokens=NEW,
                                temperature=0.0, pad_token_id=PAD, eos_token_id=eos,
                                stop_sequences=stops, return_lengths=True)
    np.testing.assert_array_equal(np.asarray(out), expected)
    real = [row[m == 1].tolist() for row, m in zip(np.asarray(out), np.pad(mask, (
        (0, 0), (0, NEW)), constant_values=1), strict=True)]
    ends = [next((j + 1 for j in range(NEW) if any(row[:len(row) - NEW + j + 1][-len(s):] == s
                                                   for s in stops) or row[j - NEW] == eos),
                 NEW) for row in real]
    np.testing.assert_array_equal(np.asarray(lengths), P + np.array(ends))


@pytest.fixture(scope="module")
def tiny():
    """A torch-free tfx decoder with a vocabulary of 13."""
    return Decoder(DecoderConfig(vocab_size=13, d_model=8, num_layers=1, num_heads=2, d_ff=16,
                                 max_len=32, position="rope"), rngs=nnx.Rngs(0))


def test_values_are_inputs_compiled_once(tiny):
    """Which processors are on is the program; their values (and word ids, same shape) are
    inputs: changing them compiles nothing new."""
    ids = np.arange(6).reshape(2, 3) + 1

    def run(penalty, n, words, minimum, stops):
        return np.asarray(tfx.generate(
            tiny, ids, max_new_tokens=6, temperature=0.0, eos_token_id=12,
            repetition_penalty=penalty, no_repeat_ngram_size=n, bad_words_ids=words,
            min_new_tokens=minimum, stop_sequences=stops))

    first = run(1.5, 2, [[3], [4, 5]], 3, [[7, 8]])
    size = _generate._cache_size()
    second = run(1.1, 3, [[9], [2, 2]], 5, [[1, 1]])
    assert _generate._cache_size() == size
    assert first.shape == second.shape == (2, 9)


TOKENS_13 = "must be token ids in [0, 13)"
LISTS = "must be a non-empty list of non-empty lists of token ids"


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0 "
                                   "(1 changes nothing) or None, got 0.0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number > 0"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be an int >= 0, got -1"),
    (dict(no_repeat_ngram_size=2.0), "no_repeat_ngram_size must be an int >= 0, got 2.0"),
    (dict(min_new_tokens=3), "min_new_tokens holds EOS back: it needs eos_token_id"),
    (dict(min_new_tokens=-1, eos_token_id=2), "min_new_tokens must be an int >= 0, got -1"),
    (dict(bad_words_ids=[1, 2]), f"bad_words_ids {LISTS}, got [1, 2]"),
    (dict(bad_words_ids=[]), f"bad_words_ids {LISTS}, got []"),
    (dict(bad_words_ids=[[3], []]), f"bad_words_ids {LISTS}"),
    (dict(bad_words_ids="ab"), f"bad_words_ids {LISTS}, got 'ab'"),
    (dict(bad_words_ids=[[13]]), f"bad_words_ids {TOKENS_13}, got [13]"),
    (dict(stop_sequences=[[1], [-1]]), f"stop_sequences {TOKENS_13}, got [-1]"),
    (dict(stop_sequences=[[1], "ab"]), f"stop_sequences {LISTS}"),
])
def test_bad_arguments_are_refused_before_compiling(tiny, kwargs, match):
    size = _generate._cache_size()
    with pytest.raises(ValueError, match=re.escape(match)):
        tfx.generate(tiny, [[1, 2, 3]], max_new_tokens=2, temperature=0.0, **kwargs)
    assert _generate._cache_size() == size


def test_an_eos_bad_word_is_dropped_as_in_transformers(tiny):
    """transformers' NoBadWordsLogitsProcessor drops single-token bad words that are EOS."""
    kwargs = dict(max_new_tokens=4, temperature=0.0, eos_token_id=5)
    plain = tfx.generate(tiny, [[1, 2, 3]], **kwargs)
    np.testing.assert_array_equal(
        tfx.generate(tiny, [[1, 2, 3]], bad_words_ids=[[5]], **kwargs), plain)
    sampled = tfx.generate(tiny, [[1, 2, 3]], max_new_tokens=4, temperature=1.0,
                           rng=jax.random.key(0), bad_words_ids=[[t] for t in range(12)])
    assert (np.asarray(sampled)[0, 3:] == 12).all()  # everything else is banned
