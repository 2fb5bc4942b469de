"""tfx.speculative_generate: greedy output equals tfx.generate(target) token for token (several
k, prompts of different lengths, EOS, a random draft, the target itself as draft); sampled
output has the target's exact distribution (enumerated); early_exit_draft is the target's first
layers; bad arguments fail before compiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decoding_cases import random_prompts
from flax import nnx

import tfx
from tfx.generation import early_exit_draft, speculative_generate
from tfx.hf.io import assign_params, flat_params, split_layer, stack_layers, unstack_layers
from tfx.models import Decoder, DecoderConfig, EncoderDecoder, EncoderDecoderConfig

VOCAB = 40
CONFIG = DecoderConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                       max_len=64, position="rope", attention={"num_kv_heads": 2},
                       embeddings={"tie": False})


def _model(config, seed, head_std=1.0):
    """A random model in eval mode whose (untied) output head has std `head_std`: larger than
    the default init, so that next-token distributions are far from uniform (greedy has clear
    winners; target and draft distributions clearly differ)."""
    model = Decoder(config, rngs=nnx.Rngs(seed))
    kernel = model.head.kernel
    kernel[...] = head_std * jax.random.normal(jax.random.key(seed), kernel[...].shape)
    model.eval()
    return model


@nnx.jit
def _logits(model, ids):
    """Full-sequence logits, compiled (eager NNX calls compile every op on its own)."""
    return model(ids)


@pytest.fixture(scope="module")
def target():
    return _model(CONFIG, 0)


@pytest.fixture(scope="module")
def random_draft():
    return _model(CONFIG.replace(num_layers=1), 1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(VOCAB)


@pytest.mark.parametrize(("draft", "k", "rng"), [
    ("random", 1, None), ("random", 3, None), ("target", 3, None), ("early exit", 3, None),
    ("random", 3, 0),  # temperature 0 with a key: the sampling rule on one-hot distributions
])
def test_greedy_equals_the_target_alone(target, random_draft, prompts, draft, k, rng):
    ids, mask = prompts
    expected = tfx.generate(target, ids, attention_mask=mask, max_new_tokens=11,
                            temperature=0.0)
    drafts = {"random": random_draft, "target": target,
              "early exit": early_exit_draft(target, 1)}
    out, stats = speculative_generate(target, drafts[draft], ids, attention_mask=mask,
                                      max_new_tokens=11, num_draft_tokens=k, temperature=0.0,
                                      rng=None if rng is None else jax.random.key(rng),
                                      return_stats=True)
    assert out.dtype == jnp.int32 and out.shape == (3, 9 + 11)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(stats.new_tokens, [11] * 3)
    if draft == "target":  # every judged token accepted: k + 1 tokens per round
        assert stats.acceptance_rate == 1.0
        np.testing.assert_array_equal(stats.accepted, stats.drafted)
        np.testing.assert_array_equal(stats.target_calls, 1 + -(-10 // (k + 1)))


def test_random_draft_is_mostly_rejected_and_still_exact(target, random_draft, prompts):
    ids, mask = prompts
    _, stats = speculative_generate(target, random_draft, ids, attention_mask=mask,
                                    max_new_tokens=11, num_draft_tokens=3, temperature=0.0,
                                    return_stats=True)
    assert stats.acceptance_rate < 0.5
    np.testing.assert_array_equal(stats.new_tokens, [11] * 3)
    assert (stats.target_calls > 1 + 10 / (3 + 1)).all()  # more rounds than all-accepted


def test_eos_and_lengths_like_generate(target, random_draft, prompts):
    ids, mask = prompts
    plain = np.asarray(tfx.generate(target, ids, attention_mask=mask, max_new_tokens=11,
                                    temperature=0.0))
    eos = int(plain[0, 9 + 3])  # row 0's fourth new token: it stops there (or earlier)
    expected, expected_lengths = tfx.generate(
        target, ids, attention_mask=mask, max_new_tokens=11, temperature=0.0, eos_token_id=eos,
        pad_token_id=0, return_lengths=True)
    for draft in (random_draft, target):
        out, lengths, stats = speculative_generate(
            target, draft, ids, attention_mask=mask, max_new_tokens=11, num_draft_tokens=3,
            temperature=0.0, eos_token_id=eos, pad_token_id=0, return_lengths=True,
            return_stats=True)
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(lengths, expected_lengths)
        np.testing.assert_array_equal(stats.new_tokens, np.asarray(lengths) - 9)
    assert np.asarray(expected_lengths)[0] <= 9 + 4 and (np.asarray(out)[0, 9 + 4:] == 0).all()


def test_early_exit_draft_is_the_first_layers(target, prompts):
    """The draft's logits equal those of a 1-layer model given the target's embeddings, first
    layer, final norm and head, with unrolled and with scanned (stacked) layers."""
    ids, mask = prompts
    reference = _first_layer_reference(target)
    for model in (target, _scanned_copy(target)):
        draft = early_exit_draft(model, 1)
        assert draft.config.num_layers == 1
        assert draft.embeddings is model.embeddings and draft.head is model.head
        np.testing.assert_allclose(_logits(draft, ids), _logits(reference, ids),
                                   atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_logits(early_exit_draft(target, 2), ids), _logits(target, ids),
                               atol=1e-6)
    # Scanned layers decode too (their weights ride the loop carries): the target's tokens.
    out = speculative_generate(model, draft, ids, attention_mask=mask, max_new_tokens=11,
                               num_draft_tokens=3, temperature=0.0)
    np.testing.assert_array_equal(out, tfx.generate(target, ids, attention_mask=mask,
                                                     max_new_tokens=11, temperature=0.0))


def _scanned_copy(model):
    """`model` with stacked layers (compute.scan_layers), the same weights."""
    scanned = Decoder(model.config.replace(compute={"scan_layers": True}), rngs=nnx.Rngs(5))
    assign_params(scanned, stack_layers(flat_params(model)), source="test")
    scanned.eval()
    return scanned


def _first_layer_reference(model):
    """A plain 1-layer Decoder holding `model`'s weights but for its layers after the first."""
    params = unstack_layers(flat_params(model))
    kept = {path: value for path, value in params.items() if split_layer(path)[1] in (None, 0)}
    reference = Decoder(model.config.replace(num_layers=1), rngs=nnx.Rngs(7))
    assign_params(reference, kept, source="test")
    reference.eval()
    return reference


# A vocabulary small enough to enumerate every continuation.
SMALL = DecoderConfig(vocab_size=6, d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=16,
                      position="rope", embeddings={"tie": False})
SAMPLES = 20000
SAMPLING = {"temperature": 0.9, "top_k": 4}


@pytest.mark.parametrize("k", [1, 2])
def test_sampling_has_the_targets_exact_distribution(k):
    """Generated tokens 2 and 3 (the first ones the draft proposes: token 1 comes from the
    prefill) of SAMPLES rows of one prompt, against the target's exact joint distribution
    enumerated over all continuations. With max_new_tokens=3, k=1 exercises the bonus token
    (all accepted) and k=2 a rejection followed by a second round on rewound caches.

    Bound: the empirical total-variation distance of n samples over 36 cells is about
    0.5 * sum_i sqrt(2 p_i / (pi n)) <= 0.5 * 6 * sqrt(2 / (pi n)) = 0.017 (n = 20000);
    the test allows 0.03. A wrong rule, "always accept the draft", would emit the draft's own
    continuations: its exact distribution is asserted to be more than 0.1 away in total
    variation, so such a rule would fail the bound by several noise levels. The draft is the
    target with a perturbed head: close enough that both acceptances and rejections occur.
    """
    target, draft = _model(SMALL, 10, head_std=0.5), _model(SMALL, 10, head_std=0.5)
    draft.head.kernel[...] += 0.5 * jax.random.normal(jax.random.key(11), (16, 6))  # close
    prompt = np.array([[1, 4, 2]])
    out, stats = speculative_generate(
        target, draft, np.repeat(prompt, SAMPLES, axis=0), max_new_tokens=3,
        num_draft_tokens=k, rng=jax.random.key(k), return_stats=True, **SAMPLING)
    assert 0.2 < stats.acceptance_rate < 0.9  # both branches of the rule are exercised
    pairs = np.asarray(out)[:, 4:6]
    observed = np.bincount(pairs[:, 0] * 6 + pairs[:, 1], minlength=36) / SAMPLES
    exact = _pair_distribution(target, target, prompt).ravel()
    always_accept = _pair_distribution(target, draft, prompt).ravel()
    assert not observed[exact == 0].any()  # top-k: filtered tokens are never emitted
    assert 0.5 * np.abs(observed - exact).sum() < 0.03
    assert 0.5 * np.abs(always_accept - exact).sum() > 0.1


def _probs(logits, temperature, top_k):
    """The sampler's distribution written out: softmax over the top-k of logits / T."""
    logits = np.asarray(logits, np.float64) / temperature
    kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
    logits = np.where(logits >= kth, logits, -np.inf)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _pair_distribution(first, rest, prompt):
    """float64 [vocab, vocab]: P(token 2, token 3) when `first` draws token 1 and `rest`
    tokens 2 and 3, by enumerating tokens 1 and 2 (one batched call per model)."""
    v, length = SMALL.vocab_size, prompt.shape[1]
    pairs = np.stack(np.meshgrid(np.arange(v), np.arange(v), indexing="ij"), -1).reshape(-1, 2)
    sequences = np.concatenate([np.repeat(prompt, v * v, axis=0), pairs], axis=1)
    p1 = _probs(_logits(first, sequences[:1])[0, length - 1], **SAMPLING)  # [v]
    logits = np.asarray(_logits(rest, sequences)).reshape(v, v, length + 2, v)
    p2 = _probs(logits[:, 0, length], **SAMPLING)  # [t1, t2]
    p3 = _probs(logits[:, :, length + 1], **SAMPLING)  # [t1, t2, t3]
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"draft": "tiny-vocab"}, ValueError, "same|share the target's vocabulary"),
    ({"draft": "seq2seq"}, TypeError, "draft must be a tfx Decoder"),
    ({"num_draft_tokens": 0}, ValueError, "num_draft_tokens must be an int >= 1"),
    ({"max_new_tokens": 60}, ValueError, "exceeds the model's max_len"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"target": "sliding"}, ValueError, "ring buffer"),
    ({"target": "xl"}, ValueError, "SegmentMemory"),
])
def test_arguments_are_checked_before_compiling(target, random_draft, change, error, match):
    models = {"tiny-vocab": lambda: Decoder(SMALL, rngs=nnx.Rngs(0)),
              "seq2seq": lambda: EncoderDecoder(EncoderDecoderConfig(
                  vocab_size=VOCAB, d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=16),
                  rngs=nnx.Rngs(0)),
              "sliding": lambda: Decoder(CONFIG.replace(attention={"sliding_window": 4}),
                                         rngs=nnx.Rngs(0)),
              "xl": lambda: Decoder(CONFIG.replace(position="xl"), rngs=nnx.Rngs(0))}
    kwargs = {"target": target, "draft": random_draft, "max_new_tokens": 4,
              "temperature": 0.0} | change
    for name in ("target", "draft"):
        if isinstance(kwargs[name], str):
            kwargs[name] = models[kwargs[name]]()
    with pytest.raises(error, match=match):
        speculative_generate(input_ids=np.ones((1, 8), np.int32), **kwargs)


@pytest.mark.parametrize("layers", [0, 3, 1.0])
def test_early_exit_draft_checks_its_layer_count(target, layers):
    with pytest.raises(ValueError, match="num_layers must be"):
        early_exit_draft(target, layers)
