"""tfx.ops.kv_cache: slot planning, writes, ring buffers, and cached attention against attention
over the whole sequence."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from tfx.ops import dot_product_attention
from tfx.ops.attention import cached_attention
from tfx.ops.kv_cache import LayerKV, init_cache, write


def _cache(batch=2, max_len=8, window=None, heads=2, dim=4, stacked=False):
    return init_cache(num_layers=3, batch=batch, max_len=max_len, num_kv_heads=heads,
                      head_dim=dim, window=window, stacked=stacked)


def test_init_cache_shapes_and_bytes():
    cache = _cache(batch=2, max_len=8)
    assert len(cache.layers) == 3 and cache.window is None
    chex.assert_shape([cache.layers[0].key, cache.layers[0].value], (2, 2, 8, 4))
    np.testing.assert_array_equal(cache.positions, -np.ones((2, 8)))
    np.testing.assert_array_equal(cache.next_position, [0, 0])
    assert cache.nbytes == 3 * 2 * (2 * 2 * 8 * 4) * 4
    # GQA/MQA store only their KV heads: the saving over MHA is num_heads / num_kv_heads.
    assert _cache(heads=8).nbytes == 4 * _cache(heads=2).nbytes


def test_init_cache_ring_only_when_window_is_shorter():
    ring = _cache(max_len=32, window=5)
    assert ring.window == 5
    chex.assert_shape(ring.layers[0].key, (2, 2, 5, 4))
    linear = _cache(max_len=4, window=5)  # every position fits: no ring, no window to apply
    assert linear.window is None and linear.positions.shape == (2, 4)
    stacked = _cache(stacked=True)
    chex.assert_shape(stacked.layers.key, (3, 2, 2, 8, 4))


@pytest.mark.parametrize("bad", [dict(batch=0), dict(max_len=-1), dict(window=0)])
def test_init_cache_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        _cache(**bad)


def test_plan_places_left_and_right_padded_tokens_by_true_position():
    valid = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], bool)  # left-, right-padded
    step, cache = _cache().plan(valid)
    np.testing.assert_array_equal(step.query_positions[valid], [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(step.slots, [[8, 8, 0, 1, 2], [0, 1, 2, 8, 8]])  # 8: dropped
    np.testing.assert_array_equal(cache.positions, [[0, 1, 2] + [-1] * 5] * 2)
    np.testing.assert_array_equal(cache.next_position, [3, 3])
    step, cache = cache.plan(jnp.ones((2, 1), bool))
    np.testing.assert_array_equal(step.query_positions, [[3], [3]])
    # Only the four filled slots are visible, and they all precede the query.
    np.testing.assert_array_equal(step.mask[:, 0, 0], [[1, 1, 1, 1, 0, 0, 0, 0]] * 2)


def test_plan_mask_is_causal_valid_and_windowed():
    """Against the definition: key k visible to query q iff k is filled, k <= q, q - k < W."""
    step, _ = _cache(batch=1, max_len=16, window=4).plan(jnp.ones((1, 6), bool))
    assert step.append  # a chunk into a ring buffer attends to [old cache | new keys]
    q = np.arange(6)[:, None]
    k = np.array(step.key_positions[0])[None, :]
    expected = (k >= 0) & (k <= q) & (q - k < 4)
    np.testing.assert_array_equal(step.mask[0, 0], expected)
    # A ring buffer keeps only the last `window` tokens of the chunk, each in slot p % window.
    np.testing.assert_array_equal(step.slots[0], [4, 4, 2, 3, 0, 1])


class CachedAttentionTest(parameterized.TestCase):
    """Decoding token by token through `write` + `cached_attention` equals causal attention over
    the whole sequence (`dot_product_attention`, reference), for a linear cache and a ring."""

    @parameterized.named_parameters(("linear", None, None), ("ring", 3, None), ("ring_gqa", 3, 1))
    def test_token_by_token_equals_full_sequence(self, window, kv_heads):
        batch, seq, heads, dim = 2, 9, 4, 8
        kv_heads = kv_heads or heads
        keys = jax.random.split(jax.random.key(0), 3)
        query = jax.random.normal(keys[0], (batch, seq, heads, dim))
        key = jax.random.normal(keys[1], (batch, seq, kv_heads, dim))
        value = jax.random.normal(keys[2], (batch, seq, kv_heads, dim))
        mask = np.tril(np.ones((seq, seq), bool))
        if window is not None:
            mask &= ~np.tril(np.ones((seq, seq), bool), -window)
        full = dot_product_attention(query, key, value, mask=jnp.asarray(mask),
                                     implementation="reference")
        cache = init_cache(num_layers=1, batch=batch, max_len=seq, num_kv_heads=kv_heads,
                           head_dim=dim, window=window)
        layer, outs = cache.layers[0], []
        for t in range(seq):
            step, cache = cache.plan(jnp.ones((batch, 1), bool))
            k, v, layer = write(layer, key[:, t:t + 1], value[:, t:t + 1], step)
            outs.append(cached_attention(query[:, t:t + 1], k, v, mask=step.mask))
        chex.assert_trees_all_close(jnp.concatenate(outs, axis=1), full, atol=1e-5)
        if window is not None:
            chex.assert_shape(layer.key, (batch, kv_heads, window, dim))


@pytest.mark.parametrize("q_len", [1, 3])  # 1: a decoding step
def test_cached_attention_matches_reference_with_bias_and_mask(q_len):
    keys = jax.random.split(jax.random.key(1), 4)
    query = jax.random.normal(keys[0], (2, q_len, 4, 8))
    key = jax.random.normal(keys[1], (2, 5, 2, 8))
    value = jax.random.normal(keys[2], (2, 5, 2, 8))
    bias = jax.random.normal(keys[3], (2, 4, q_len, 5))
    mask = jnp.array([True, True, False, True, True])[None, None, None]
    expected = dot_product_attention(query, key, value, bias=bias, mask=mask,
                                     implementation="reference")
    got = cached_attention(query, jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2),
                           bias=bias, mask=mask)
    chex.assert_trees_all_close(got, expected, atol=1e-6)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cached_attention(query, key, value)  # not heads-major


def test_take_gathers_rows_of_every_layer():
    cache = _cache(batch=3)
    cache = cache.plan(jnp.array([[1], [1], [0]], bool))[1]
    layers = tuple(LayerKV(layer.key + i, layer.value - i) for i, layer in enumerate(cache.layers))
    cache = cache.__class__(layers=layers, positions=cache.positions,
                            next_position=cache.next_position, window=cache.window)
    taken = cache.take(jnp.array([2, 0, 0]))
    np.testing.assert_array_equal(taken.next_position, [0, 1, 1])
    assert taken.layers[2].key.shape[0] == 3
    stacked = _cache(batch=3, stacked=True).take(jnp.array([1, 1]))
    chex.assert_shape(stacked.layers.key, (3, 2, 2, 8, 4))
