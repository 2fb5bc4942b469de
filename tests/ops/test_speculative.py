"""tfx.ops.speculative (the accept/reject rule on plain arrays) and KVCache.rewind."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import Decoder, DecoderConfig
from tfx.ops.kv_cache import init_cache
from tfx.ops.speculative import token_probs, verify_draft


def test_one_position_is_distributed_as_the_target():
    """Leviathan et al.'s identity on one position: q(x) min(1, p(x)/q(x)) plus the rejection
    mass times normalize(max(0, p - q)) is p(x). Empirically over 200000 rows the frequency of
    each emitted token is within 0.006 of p (4.5 standard deviations of the largest cell);
    emitting the draft token always would give q, 0.2 or more away in some cell."""
    p = jnp.array([0.5, 0.2, 0.2, 0.1, 0.0])
    q = jnp.array([0.1, 0.5, 0.1, 0.1, 0.2])
    rows = 200_000
    drafts = jax.random.categorical(jax.random.key(0), jnp.log(q), shape=(rows, 1))
    target = jnp.broadcast_to(p, (rows, 2, 5))  # position 2 is the bonus: never reached here
    accepted, token = verify_draft(target, jnp.broadcast_to(q, (rows, 1, 5)), drafts,
                                   jnp.ones((rows,), jnp.int32), jax.random.key(1))
    emitted = np.where(np.asarray(accepted) == 1, np.asarray(drafts)[:, 0], np.asarray(token))
    frequency = np.bincount(emitted, minlength=5) / rows
    np.testing.assert_allclose(frequency, p, atol=0.006)
    assert frequency[4] == 0  # p = 0: never emitted, although the draft proposes it
    assert np.abs(np.asarray(q) - np.asarray(p)).max() >= 0.2


def test_greedy_accepts_up_to_the_first_mismatch_and_corrects_it():
    """One-hot distributions (temperature 0): accepted = the leading draft tokens equal to the
    target's argmax, then the target's argmax; with all accepted, the bonus argmax."""
    target_logits = jnp.array([[[0., 3, 1], [2, 0, 1], [0, 1, 5], [9, 0, 0]]] * 3)  # argmax 1 0 2 0
    drafts = jnp.array([[1, 0, 1], [1, 0, 2], [2, 0, 2]])
    p = token_probs(target_logits, temperature=0.0)
    q = jax.nn.one_hot(drafts, 3)
    accepted, token = verify_draft(p, q, drafts, jnp.array([3, 3, 3]), jax.random.key(0))
    np.testing.assert_array_equal(accepted, [2, 3, 0])
    np.testing.assert_array_equal(token, [2, 0, 1])
    accepted, token = verify_draft(p, q, drafts, jnp.array([1, 0, 3]), jax.random.key(0))
    np.testing.assert_array_equal(accepted, [1, 0, 0])  # never beyond the limit


def test_token_probs_follows_the_sampler_filters():
    logits = jnp.array([[1.0, 3.0, 2.0, 0.0]])
    kept = np.exp(np.array([1.0, 3.0, 2.0]) / 0.5)  # temperature 0.5, then the top 3
    np.testing.assert_allclose(token_probs(logits, temperature=0.5, top_k=3)[0],
                               [*(kept / kept.sum()), 0.0], rtol=1e-5)
    np.testing.assert_array_equal(token_probs(logits, temperature=0.0)[0], [0, 1, 0, 0])


def test_rewind_forgets_tokens_as_if_never_fed():
    """Feed 6 tokens, rewind row 0 to 3 and row 1 to 5, feed 2 more: the logits equal those of
    a cache that only ever saw the kept tokens and the new ones."""
    config = DecoderConfig(vocab_size=30, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                           max_len=16, position="rope")
    model = Decoder(config, rngs=nnx.Rngs(0))
    call = nnx.jit(lambda model, ids, cache=None: model(ids, cache=cache))  # not op by op
    ids = np.random.default_rng(0).integers(0, 30, (2, 8))
    _, cache = call(model, ids[:, :6], model.init_cache(2, 16))
    cache = cache.rewind(jnp.array([3, 5]))
    np.testing.assert_array_equal(cache.next_position, [3, 5])
    np.testing.assert_array_equal(cache.positions[:, :7],
                                  [[0, 1, 2, -1, -1, -1, -1], [0, 1, 2, 3, 4, -1, -1]])
    logits, _ = call(model, ids[:, 6:], cache)
    for row, kept in enumerate([3, 5]):
        fresh = np.concatenate([ids[row, :kept], ids[row, 6:]])[None]
        np.testing.assert_allclose(logits[row], call(model, fresh)[0, -2:], atol=1e-5,
                                   rtol=1e-5)
    # A rewind never extends a row: asking for more keeps its length.
    np.testing.assert_array_equal(cache.rewind(jnp.array([9, 2])).next_position, [3, 2])


def test_rewind_refuses_a_ring_buffer():
    ring = init_cache(num_layers=1, batch=1, max_len=16, num_kv_heads=1, head_dim=4, window=4)
    with pytest.raises(ValueError, match=r"ring-buffer KV cache .* cannot be rewound"):
        ring.rewind(jnp.array([0]))
