"""tfx.generation.beam_search: parity with transformers' beam search for T5, and torch-free
properties (one beam is greedy, more beams score at least as well, arguments are checked)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx.hf
from tfx.generation.beam_search import _beam_search, beam_search
from tfx.generation.generate import generate
from tfx.models import create

NEW = 10
PAD = 2
EOS = 44  # produced by the torch-free model's greedy and beam outputs


def _sources(vocab_size: int):
    """int [3, 9] sources, the second and third right-padded, and their attention_mask."""
    ids = np.random.default_rng(0).integers(3, vocab_size, size=(3, 9))
    mask = np.ones_like(ids)
    mask[1, 6:] = mask[2, 4:] = 0
    return np.where(mask, ids, 0), mask


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A tiny random T5 v1.1 (perturbed weights, own lm_head) in transformers and in tfx."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # Equal encoder and decoder depths: transformers 5.24's generate sizes T5's cache by the
    # encoder's num_layers.
    config = transformers.T5Config(
        vocab_size=99, d_model=32, d_kv=12, d_ff=48, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        attn_implementation="eager")
    hf_model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():  # norms are ones at init: make every weight matter
            param.add_(0.3 * torch.randn_like(param))
        hf_model.lm_head.weight = torch.nn.Parameter(torch.randn(99, 32))
    folder = tmp_path_factory.mktemp("t5")
    hf_model.save_pretrained(folder)
    return torch, hf_model, tfx.hf.load(folder)


# Each eos is produced by some of transformers' hypotheses (checked in the test). With these
# weights the second setting's output changes if early_stopping is False, and the last two
# (one compiled program) tell "never" from False and pin the length in the early-stopping
# heuristic (the current one: counting one more changes the fourth's output).
SETTINGS = [
    dict(num_beams=2, length_penalty=1.0, early_stopping=False, eos_token_id=51),
    dict(num_beams=4, length_penalty=0.6, early_stopping=True, eos_token_id=82,
         num_return_sequences=2),
    dict(num_beams=4, length_penalty=2.0, early_stopping=False, eos_token_id=[56, 31],
         num_return_sequences=3),
    dict(num_beams=2, length_penalty=0.5, early_stopping="never", eos_token_id=65,
         max_new_tokens=20),
    dict(num_beams=2, length_penalty=0.5, early_stopping=False, eos_token_id=65,
         max_new_tokens=20),
    # Processors over the decoder's tokens, the start token included (as transformers).
    dict(num_beams=3, length_penalty=1.0, early_stopping=False, eos_token_id=51,
         repetition_penalty=1.4, no_repeat_ngram_size=2, bad_words_ids=[[56], [31, 82]]),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s['num_beams']}-beams-"
                         f"lp{s['length_penalty']}-{s['early_stopping']}")
def test_matches_transformers(hf_pair, setting):
    torch, hf_model, model = hf_pair
    ids, mask = _sources(99)
    setting = {"max_new_tokens": NEW, **setting}
    with torch.no_grad():
        out = hf_model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                do_sample=False, pad_token_id=PAD, return_dict_in_generate=True,
                                output_scores=True, **setting)
    expected = out.sequences.numpy()
    assert np.isin(expected[:, 1:], setting["eos_token_id"]).any()  # the eos matters here
    # transformers crops to the longest hypothesis returned; tfx always returns all the steps.
    width = 1 + setting["max_new_tokens"]
    expected = np.pad(expected, ((0, 0), (0, width - expected.shape[1])), constant_values=PAD)
    tokens, scores = beam_search(model, ids, attention_mask=mask, pad_token_id=PAD,
                                 return_scores=True, **setting)
    np.testing.assert_array_equal(np.asarray(tokens), expected)
    np.testing.assert_allclose(np.asarray(scores), out.sequences_scores.numpy(), rtol=1e-4)


@pytest.fixture(scope="module")
def model():
    """A tiny random tfx T5 (no torch) with a scaled-up head, so that its next-token
    distributions are peaked rather than nearly uniform (no near-ties)."""
    model = create("t5-small", rngs=nnx.Rngs(0), dropout=0.0, num_layers=2, d_model=32,
                   num_heads=4, d_ff=64, vocab_size=97, embeddings={"tie": False})
    model.head.kernel[...] = 6.0 * model.head.kernel[...]
    return model


def _log_prob(model, ids, mask, tokens, eos: int) -> np.ndarray:
    """Teacher-forced summed log-probability [batch] of tokens [batch, 1 + new] (start token
    first), up to and including the first eos."""
    logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                   decoder_input_ids=jnp.asarray(tokens[:, :-1]))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = np.take_along_axis(np.asarray(log_probs), tokens[:, 1:, None], axis=-1)[..., 0]
    ended_before = np.cumsum(tokens[:, 1:] == eos, axis=1) - (tokens[:, 1:] == eos)
    return np.where(ended_before == 0, picked, 0.0).sum(axis=1)


@pytest.mark.parametrize("eos", [None, EOS])
def test_one_beam_is_greedy(model, eos):
    ids, mask = _sources(97)
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, temperature=0.0,
                      eos_token_id=eos, bucket=False)
    beam = beam_search(model, ids, attention_mask=mask, num_beams=1, max_new_tokens=NEW,
                       eos_token_id=eos)
    np.testing.assert_array_equal(np.asarray(beam), np.asarray(greedy))
    assert eos is None or (np.asarray(greedy) == eos).any()


def test_beams_score_at_least_greedy(model):
    """Without a length penalty the score is the summed log-probability; recomputed by
    teacher forcing it matches, and the best of 4 beams is no worse than greedy here (beam
    search does not guarantee it in general)."""
    ids, mask = _sources(97)
    eos = EOS
    greedy = np.asarray(generate(model, ids, attention_mask=mask, max_new_tokens=NEW,
                                 temperature=0.0, eos_token_id=eos, bucket=False))
    tokens, scores = beam_search(model, ids, attention_mask=mask, num_beams=4,
                                 max_new_tokens=NEW, eos_token_id=eos, length_penalty=0.0,
                                 num_return_sequences=4, return_scores=True)
    tokens, scores = np.asarray(tokens), np.asarray(scores)
    assert tokens.shape == (12, 1 + NEW) and scores.shape == (12,)
    assert np.all(np.diff(scores.reshape(3, 4), axis=1) <= 0)  # best first
    np.testing.assert_allclose(_log_prob(model, np.repeat(ids, 4, 0), np.repeat(mask, 4, 0),
                                         tokens, eos), scores, rtol=1e-4, atol=1e-4)
    best = _log_prob(model, ids, mask, tokens[::4], eos)
    assert np.all(best >= _log_prob(model, ids, mask, greedy, eos) - 1e-5)
    assert not np.array_equal(tokens[::4], greedy)  # the beams found something else
    assert (tokens == eos).any()


def test_compiled_once(model):
    ids, mask = _sources(97)
    kwargs = dict(attention_mask=mask, num_beams=3, max_new_tokens=4)
    beam_search(model, ids, **kwargs)
    before = _beam_search._cache_size()
    for penalty, stopping, eos in [(0.5, True, 7), (2.0, "never", 9), (1.0, False, None)]:
        beam_search(model, ids, length_penalty=penalty, early_stopping=stopping,
                    eos_token_id=eos, pad_token_id=0, **kwargs)
    assert _beam_search._cache_size() == before


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_beams=0), ValueError, "num_beams"),
    (dict(num_beams=2.0), ValueError, "num_beams"),
    (dict(num_return_sequences=3), ValueError, "num_return_sequences"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(early_stopping="sometimes"), ValueError, "early_stopping"),
    (dict(eos_token_id=97), ValueError, "eos_token_id"),
    (dict(num_beams=49), ValueError, "vocab"),
    (dict(attention_mask=np.ones((3, 2))), ValueError, "attention_mask"),
])
def test_bad_arguments(model, kwargs, error, match):
    ids, _ = _sources(97)
    compiled = _beam_search._cache_size()
    with pytest.raises(error, match=match):
        beam_search(model, ids, **{"num_beams": 2, "max_new_tokens": 4, **kwargs})
    assert _beam_search._cache_size() == compiled  # refused before tracing anything


def test_a_model_that_does_not_decode_is_refused():
    """An encoder (BERT) has no next-token logits; decoders are tested in
    test_decoder_beam_search.py."""
    encoder = create("bert-base", rngs=nnx.Rngs(0), num_layers=1, d_model=32, num_heads=4,
                     d_ff=64, vocab_size=97)
    with pytest.raises(TypeError, match="model must be a tfx Decoder or EncoderDecoder, got "
                                        "Encoder"):
        beam_search(encoder, np.ones((1, 3), np.int32), num_beams=2, max_new_tokens=2)
