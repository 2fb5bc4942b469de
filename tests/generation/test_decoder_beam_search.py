"""tfx.beam_search with decoders: token for token and score for score against transformers'
beam search (tiny random GPT-2 and LLaMA with GQA, left-padded prompts of 7, 3 and 5 tokens),
with and without logits processors; torch-free properties (one beam is greedy, lengths, one
compiled program, argument checks)."""

import re

import jax
import numpy as np
import pytest
from decoding_cases import NEW, PAD, hf_generate_scored, pairs_fixture, prompts
from flax import nnx

import tfx
from tfx.generation.beam_search import _beam_search
from tfx.models import Decoder, DecoderConfig

P = 7  # prompt columns
pairs = pairs_fixture()


# Each setting from the best hypotheses' new tokens [3, NEW] of a 3-beam search without EOS,
# so that its EOS ids are tokens the search produces (checked in the test). Settings 3 and 4
# differ only in early_stopping (one compiled program).
SETTINGS = [
    lambda new: dict(num_beams=3),
    lambda new: dict(num_beams=3, length_penalty=0.5, eos_token_id=int(new[1, 2]),
                     num_return_sequences=2),
    lambda new: dict(num_beams=4, length_penalty=2.0, early_stopping=True,
                     eos_token_id=[int(new[0, 3]), int(new[2, 5])], num_return_sequences=3),
    lambda new: dict(num_beams=2, length_penalty=0.5, early_stopping="never",
                     eos_token_id=int(new[2, 4])),
    lambda new: dict(num_beams=2, length_penalty=0.5, early_stopping=False,
                     eos_token_id=int(new[2, 4])),
]
# Processors change what beam search finds (checked in the test): repetition penalty and
# n-grams; bad words (single and two-token) with min_new_tokens holding back an early EOS.
PROCESSORS = [
    lambda new: dict(num_beams=2, repetition_penalty=1.3, no_repeat_ngram_size=2),
    lambda new: dict(num_beams=3, bad_words_ids=[[int(new[0, 0])], [int(new[1, 1]),
                                                                    int(new[1, 2])]],
                     min_new_tokens=4, eos_token_id=int(new[2, 1]), num_return_sequences=2),
]


def _compare(pairs, case: str, setting, *, eos_shows: bool = True):
    """tfx's tokens and scores are transformers' for `setting` (a function of free-running
    beam search's best new tokens); returns transformers' tokens and the setting. eos_shows:
    check that the setting's EOS ends some hypothesis."""
    torch, _, pair = pairs
    hf_model, model = pair(case)
    ids, mask = prompts()
    free = hf_generate_scored(torch, hf_model, ids, mask, num_beams=3)[0][:, P:]
    setting = setting(free)
    expected, scores = hf_generate_scored(torch, hf_model, ids, mask, **setting)
    if eos_shows and "eos_token_id" in setting:
        assert np.isin(expected[:, P:], setting["eos_token_id"]).any()  # the EOS matters
    tokens, ours = tfx.beam_search(model, ids, attention_mask=mask, max_new_tokens=NEW,
                                   pad_token_id=PAD, return_scores=True, **setting)
    np.testing.assert_array_equal(np.asarray(tokens), expected)
    np.testing.assert_allclose(np.asarray(ours), scores, rtol=1e-4)
    return expected, setting


# Cases take turns, so that each compiles a few programs.
@pytest.mark.parametrize(("case", "index"), [("gpt2", 0), ("llama-gqa", 1), ("gpt2", 2),
                                             ("llama-gqa", 3), ("llama-gqa", 4)])
def test_matches_transformers(pairs, case, index):
    _compare(pairs, case, SETTINGS[index])


@pytest.mark.parametrize(("case", "index"), [("llama-gqa", 0), ("gpt2", 1)])
def test_processors_match_transformers(pairs, case, index):
    expected, setting = _compare(pairs, case, PROCESSORS[index], eos_shows=False)
    torch, _, pair = pairs
    hf_model = pair(case)[0]
    plain = {k: v for k, v in setting.items()
             if k in ("num_beams", "eos_token_id", "num_return_sequences")}
    assert not np.array_equal(hf_generate_scored(torch, hf_model, *prompts(), **plain)[0],
                              expected)


@pytest.fixture(scope="module")
def tiny():
    """A torch-free tfx decoder (RoPE, GQA) with peaked next-token distributions."""
    model = Decoder(DecoderConfig(vocab_size=31, d_model=16, num_layers=1, num_heads=4,
                                  d_ff=32, max_len=32, position="rope",
                                  attention={"num_kv_heads": 2}), rngs=nnx.Rngs(0))
    model.embeddings.tokens.table[...] = 4.0 * model.embeddings.tokens.table[...]
    return model


def test_one_beam_is_greedy_and_lengths_count_to_eos(tiny):
    ids, mask = prompts()
    ids = ids % 31
    greedy = np.asarray(tfx.generate(tiny, ids, attention_mask=mask, max_new_tokens=NEW,
                                     temperature=0.0))
    eos = int(greedy[0, P + 2])
    first = P + 1 + list(greedy[0, P:]).index(eos)
    greedy, expected = tfx.generate(tiny, ids, attention_mask=mask, max_new_tokens=NEW,
                                    temperature=0.0, eos_token_id=eos, return_lengths=True)
    beam, lengths = tfx.beam_search(tiny, ids, attention_mask=mask, num_beams=1,
                                    max_new_tokens=NEW, eos_token_id=eos, return_lengths=True)
    np.testing.assert_array_equal(np.asarray(beam), np.asarray(greedy))
    np.testing.assert_array_equal(np.asarray(lengths), np.asarray(expected))
    assert np.asarray(lengths)[0] == first


@pytest.mark.parametrize("position", ["rope", "xl"])
def test_scores_are_teacher_forced_log_probs(position):
    """With length_penalty 0 and no EOS a hypothesis' score is its summed log-probability:
    recomputed without a cache, it matches only if the cache rows (KV cache, or Transformer-XL
    memory) followed their beams."""
    model = Decoder(DecoderConfig(vocab_size=31, d_model=16, num_layers=2, num_heads=4,
                                  d_ff=32, max_len=32, position=position), rngs=nnx.Rngs(1))
    model.embeddings.tokens.table[...] = 4.0 * model.embeddings.tokens.table[...]
    ids, mask = prompts()
    ids, new = ids % 31, 6
    tokens, scores = tfx.beam_search(model, ids, attention_mask=mask, num_beams=3,
                                     max_new_tokens=new, length_penalty=0.0,
                                     num_return_sequences=3, return_scores=True)
    tokens, scores = np.asarray(tokens), np.asarray(scores)
    full_mask = np.pad(np.repeat(mask, 3, axis=0), ((0, 0), (0, new)), constant_values=1)
    log_probs = jax.nn.log_softmax(model(tokens, attention_mask=full_mask), axis=-1)
    picked = np.take_along_axis(np.asarray(log_probs)[:, P - 1:-1], tokens[:, P:, None], -1)
    np.testing.assert_allclose(picked.sum(axis=(1, 2)), scores, rtol=1e-4, atol=1e-4)
    assert len({tuple(row) for row in tokens[:3, P:].tolist()}) == 3  # three hypotheses


def test_compiled_once(tiny):
    """Penalties, early stopping, EOS ids (of one count) and processor values are inputs."""
    ids, mask = prompts()
    kwargs = dict(attention_mask=mask, num_beams=3, max_new_tokens=5, pad_token_id=0)
    tfx.beam_search(tiny, ids % 31, length_penalty=1.0, eos_token_id=3,
                    repetition_penalty=1.2, bad_words_ids=[[4, 5]], **kwargs)
    before = _beam_search._cache_size()
    for penalty, stopping, eos, repetition, word in [(0.5, True, 7, 1.5, [9, 9]),
                                                     (2.0, "never", 9, 0.8, [1, 2])]:
        tfx.beam_search(tiny, ids % 31, length_penalty=penalty, early_stopping=stopping,
                        eos_token_id=eos, repetition_penalty=repetition, bad_words_ids=[word],
                        **kwargs)
    assert _beam_search._cache_size() == before


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_new_tokens=30), "prompt (7 tokens) + max_new_tokens (30) exceeds the model's "
                              "max_len (32)"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number > 0"),
    (dict(no_repeat_ngram_size=1.5), "no_repeat_ngram_size must be an int >= 0, got 1.5"),
    (dict(min_new_tokens=2), "min_new_tokens holds EOS back: it needs eos_token_id"),
    (dict(bad_words_ids=[[31]]), "bad_words_ids must be token ids in [0, 31), got [31]"),
    (dict(num_beams=16), "num_beams (16) is too large for the vocabulary: each step keeps 32 "
                         "candidates, more than vocab_size (31)"),
])
def test_bad_arguments_are_refused_before_compiling(tiny, kwargs, match):
    ids, mask = prompts()
    size = _beam_search._cache_size()
    with pytest.raises(ValueError, match=re.escape(match)):
        tfx.beam_search(tiny, ids % 31, **{"attention_mask": mask, "num_beams": 2,
                                           "max_new_tokens": 4, **kwargs})
    assert _beam_search._cache_size() == size
