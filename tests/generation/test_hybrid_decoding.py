"""A hybrid decoder (Gated DeltaNet linear layers beside attention layers, Qwen3-Next style)
in every dense decoding path, against recomputation without a cache written out here:
tfx.generate (greedy, sampled with a fixed key, EOS) on left-padded prompts of different
lengths, beam search against a beam search that recomputes every beam's full forward, and
speculative decoding with a hybrid target and/or draft against tfx.generate token for token
(the recurrent states rewound to the accepted length)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decoding_cases import random_prompts
from flax import nnx

import tfx
from tfx.generation import beam_search, speculative_generate
from tfx.models import Decoder, DecoderConfig
from tfx.nn import DeltaState
from tfx.ops.sampling import sample_logits

VOCAB = 48
NEW = 7


def _hybrid(layer_types=("linear", "full", "linear"), seed=0, head_std=1.0):
    """A tiny hybrid decoder in eval mode (attention only without "linear" layer types); its
    untied head has std `head_std`, so that greedy choices have clear winners."""
    hybrid = "linear" in layer_types
    config = DecoderConfig(
        vocab_size=VOCAB, d_model=32, num_layers=len(layer_types), num_heads=4, d_ff=64,
        max_len=64, position="rope", norm={"kind": "rms"}, use_bias=False,
        embeddings={"tie": False},
        attention={"layer_types": layer_types, "num_kv_heads": 2},
        linear={"heads": 4, "key_heads": 2, "key_dim": 8, "value_dim": 8, "chunk_size": 4}
        if hybrid else None)
    model = Decoder(config, rngs=nnx.Rngs(seed))
    kernel = model.head.kernel
    kernel[...] = head_std * jax.random.normal(jax.random.key(seed), kernel[...].shape)
    model.eval()
    return model


@pytest.fixture(scope="module")
def model():
    return _hybrid()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(VOCAB)


@nnx.jit
def _last_logits(model, ids, mask):
    """The next-token logits of each row, recomputed over the whole sequence (no cache)."""
    return model(ids, attention_mask=mask)[:, -1]


def _recomputed(model, ids, mask, new, *, rng=None, temperature=0.0, eos=None, pad=0):
    """tfx.generate's loop without a cache: the full forward of prompt + tokens so far at each
    step, token i drawn with fold_in(rng, i); a row that produced EOS gets `pad` after it."""
    tokens, done = [], np.zeros(len(ids), bool)
    for i in range(new):
        logits = _last_logits(model, jnp.asarray(ids), jnp.asarray(mask))
        key = None if rng is None else jax.random.fold_in(rng, i)
        token = np.asarray(sample_logits(logits, key, temperature=temperature))
        token = np.where(done, pad, token)
        done |= token == eos if eos is not None else False
        tokens.append(token)
        ids = np.concatenate([ids, token[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((len(ids), 1), mask.dtype)], axis=1)
    return np.stack(tokens, axis=1)


def test_greedy_equals_recomputation_on_left_padded_prompts(model, prompts):
    ids, mask = prompts
    out = tfx.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out)[:, 9:], _recomputed(model, ids, mask, NEW))
    # each row alone, unpadded, continues the same way: padding changed no state
    for row, start in enumerate((0, 5, 3)):
        alone = tfx.generate(model, ids[row:row + 1, start:], max_new_tokens=NEW,
                             temperature=0.0)
        np.testing.assert_array_equal(np.asarray(alone)[0, 9 - start:], np.asarray(out)[row, 9:])


def test_sampling_with_a_key_equals_recomputation(model, prompts):
    ids, mask = prompts
    rng = jax.random.key(3)
    out = tfx.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, temperature=1.5,
                       rng=rng)
    want = _recomputed(model, ids, mask, NEW, rng=rng, temperature=1.5)
    np.testing.assert_array_equal(np.asarray(out)[:, 9:], want)
    assert not np.array_equal(want, _recomputed(model, ids, mask, NEW))  # not greedy


def test_eos_stops_each_row_and_pads(model, prompts):
    ids, mask = prompts
    greedy = _recomputed(model, ids, mask, NEW)
    eos = int(greedy[0, 2])  # row 0 stops at its third token (or earlier)
    out, lengths = tfx.generate(model, ids, attention_mask=mask, max_new_tokens=NEW,
                                temperature=0.0, eos_token_id=eos, pad_token_id=1,
                                return_lengths=True)
    want = _recomputed(model, ids, mask, NEW, eos=eos, pad=1)
    np.testing.assert_array_equal(np.asarray(out)[:, 9:], want)
    ended = [int(np.argmax(row == eos)) + 1 if (row == eos).any() else NEW for row in want]
    np.testing.assert_array_equal(lengths, 9 + np.asarray(ended))
    assert ended[0] <= 3 and (np.asarray(out)[0, 9 + ended[0]:] == 1).all()


def _recomputed_beams(model, ids, mask, beams, new):
    """Beam search without EOS written out: every step scores each running beam's every next
    token by the full forward of its sequence, and the best `beams` (beam, token) pairs by
    summed log-probability run on (one beam at the start). Returns the final beams' tokens
    [beams, new] and summed log-probabilities [beams], best first (one prompt)."""
    running, scores = [[]], np.zeros(1)
    for _ in range(new):
        seqs = np.asarray([np.concatenate([ids, tokens]) for tokens in running], np.int32)
        masks = np.asarray([np.concatenate([mask, np.ones(len(tokens), mask.dtype)])
                            for tokens in running])
        log_probs = np.asarray(jax.nn.log_softmax(_last_logits(model, seqs, masks), axis=-1))
        candidates = (scores[:, None] + log_probs).reshape(-1)
        best = np.argsort(-candidates, kind="stable")[:beams]
        running = [running[b // VOCAB] + [b % VOCAB] for b in best]
        scores = candidates[best]
    return np.asarray(running), scores


def test_beam_search_equals_recomputed_beams(model, prompts):
    ids, mask = prompts
    tokens, scores = beam_search(model, ids, attention_mask=mask, num_beams=3,
                                 max_new_tokens=4, eos_token_id=[], length_penalty=0.0,
                                 num_return_sequences=3, return_scores=True)
    tokens, scores = np.asarray(tokens).reshape(3, 3, -1), np.asarray(scores).reshape(3, 3)
    for row in range(3):
        want_tokens, want_scores = _recomputed_beams(model, ids[row], mask[row], 3, 4)
        np.testing.assert_array_equal(tokens[row, :, 9:], want_tokens)
        np.testing.assert_allclose(scores[row], want_scores, rtol=1e-5, atol=1e-5)


def test_one_beam_with_eos_is_greedy(model, prompts):
    ids, mask = prompts
    eos = int(_recomputed(model, ids, mask, NEW)[1, 1])
    greedy = tfx.generate(model, ids, attention_mask=mask, max_new_tokens=NEW,
                          temperature=0.0, eos_token_id=eos, pad_token_id=0, bucket=False)
    beam = beam_search(model, ids, attention_mask=mask, num_beams=1, max_new_tokens=NEW,
                       eos_token_id=eos, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(beam), np.asarray(greedy))
    assert (np.asarray(greedy)[1, 9:] == eos).any()


@pytest.fixture(scope="module")
def drafts():
    """A hybrid draft (other weights, other layer types) and an attention-only one."""
    return {"hybrid": _hybrid(("linear", "linear", "full"), seed=1),
            "attention": _hybrid(("full",), seed=2)}


@pytest.mark.parametrize(("target_kind", "draft_kind", "k"), [
    ("hybrid", "attention", 3), ("hybrid", "hybrid", 1), ("hybrid", "hybrid", 4),
    ("attention", "hybrid", 3), ("hybrid", "self", 3),
])
def test_speculative_greedy_equals_generate(model, drafts, prompts, target_kind, draft_kind,
                                            k):
    ids, mask = prompts
    target = model if target_kind == "hybrid" else drafts["attention"]
    draft = target if draft_kind == "self" else drafts[draft_kind]
    expected = tfx.generate(target, ids, attention_mask=mask, max_new_tokens=11,
                            temperature=0.0)
    out, stats = speculative_generate(target, draft, ids, attention_mask=mask,
                                      max_new_tokens=11, num_draft_tokens=k, temperature=0.0,
                                      return_stats=True)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(stats.new_tokens, [11] * 3)
    if draft_kind == "self":  # every draft accepted: no state is ever rewound
        assert stats.acceptance_rate == 1.0
    else:  # rejections happened, so the states were rewound (and right)
        assert stats.acceptance_rate < 1.0


def test_speculative_eos_equals_generate(model, drafts, prompts):
    ids, mask = prompts
    eos = int(np.asarray(tfx.generate(model, ids, attention_mask=mask, max_new_tokens=11,
                                      temperature=0.0))[2, 9 + 4])
    expected = tfx.generate(model, ids, attention_mask=mask, max_new_tokens=11,
                            temperature=0.0, eos_token_id=eos, pad_token_id=0)
    out = speculative_generate(model, drafts["hybrid"], ids, attention_mask=mask,
                               max_new_tokens=11, num_draft_tokens=3, temperature=0.0,
                               eos_token_id=eos, pad_token_id=0)
    np.testing.assert_array_equal(out, expected)


def test_cache_bytes_count_attention_tokens_apart_from_fixed_states(model):
    cache = model.init_cache(2, 16)
    # the one attention layer: keys and values of 2 KV heads × 8 dims, float32, per token
    assert cache.bytes_per_token == 2 * 2 * 8 * 4
    # two linear layers, per row: conv state [3 taps, 2·2·8 + 4·8 channels], delta [4, 8, 8]
    assert cache.state_bytes == 2 * 2 * (3 * 64 + 4 * 8 * 8) * 4
    assert cache.nbytes == cache.state_bytes + 2 * 16 * cache.bytes_per_token
    rewindable = model.init_cache(2, 16, rewind=3)  # a ring of 3 more states, and lengths
    assert rewindable.bytes_per_token == cache.bytes_per_token
    assert rewindable.state_bytes == 4 * cache.state_bytes + 2 * 2 * (3 + 1) * 4


def test_rewinding_linear_layers_needs_a_history(model):
    with pytest.raises(ValueError, match=r"init_cache\(\.\.\., rewind=n\)"):
        model.init_cache(1, 8).rewind(jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="rewind must be an int >= 0"):
        model.init_cache(1, 8, rewind=-1)


def test_a_model_of_linear_layers_only_caches_no_keys(prompts):
    model = _hybrid(("linear", "linear"), seed=4)
    cache = model.init_cache(3, 16)
    assert all(isinstance(layer, DeltaState) for layer in cache.layers)
    assert cache.bytes_per_token == 0 and cache.positions.shape == (3, 16)
    ids, mask = prompts
    out = tfx.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out)[:, 9:], _recomputed(model, ids, mask, NEW))
