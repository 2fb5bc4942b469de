"""Tests for T5's relative position buckets and bias (tfx.ops.positional.t5).

References: the published bucket values (REFERENCES.md, from T5 / mesh-tensorflow), Hugging Face's
T5Attention (bucket function and compute_bias) run in torch, and a written-out gather.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops.positional.t5 import (
    relative_positions,
    t5_relative_bias,
    t5_relative_position_bucket,
)


@pytest.mark.parametrize(
    ("offset", "bucket"),
    [(-200, 15), (-20, 10), (-8, 8), (-1, 1), (0, 0), (1, 17), (8, 24), (20, 26), (128, 31)],
)
def test_published_bidirectional_buckets(offset, bucket):
    assert int(t5_relative_position_bucket(jnp.int32(offset))) == bucket


@pytest.mark.parametrize(("offset", "bucket"), [(-200, 31), (-20, 17), (-8, 8), (1, 0), (50, 0)])
def test_published_causal_buckets(offset, bucket):
    assert int(t5_relative_position_bucket(jnp.int32(offset), bidirectional=False)) == bucket


def test_output_is_int32_with_input_shape():
    out = t5_relative_position_bucket(jnp.zeros((2, 3, 4), jnp.int16))
    chex.assert_shape(out, (2, 3, 4))
    chex.assert_type(out, jnp.int32)


@pytest.mark.parametrize(
    ("num_buckets", "max_distance", "bidirectional"),
    [(32, 128, True), (32, 128, False), (64, 256, True), (16, 64, False), (8, 20, True),
     (4, 3, True), (2, 2, False), (40, 1000, False), (10, 17, False)],
)
def test_buckets_match_hugging_face(num_buckets, max_distance, bidirectional):
    torch = pytest.importorskip("torch")
    modeling_t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    offsets = np.arange(-3000, 3001, dtype=np.int32)
    expected = modeling_t5.T5Attention._relative_position_bucket(
        torch.tensor(offsets, dtype=torch.long),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    ).numpy()
    ours = t5_relative_position_bucket(
        jnp.asarray(offsets),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    )
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize(
    ("is_decoder", "q_len", "kv_len", "past"), [(False, 9, 9, 0), (True, 3, 8, 5), (True, 6, 6, 0)]
)
def test_bias_matches_hugging_face_compute_bias(is_decoder, q_len, kv_len, past):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    modeling_t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    config = transformers.T5Config(
        d_model=8, d_kv=4, num_heads=3, relative_attention_num_buckets=16,
        relative_attention_max_distance=20, is_decoder=is_decoder,
    )
    attention = modeling_t5.T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    table = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    with torch.no_grad():
        attention.relative_attention_bias.weight.copy_(torch.from_numpy(table))
        expected = attention.compute_bias(q_len, kv_len, past_seen_tokens=past)[0].numpy()
    ours = t5_relative_bias(
        jnp.asarray(table),
        jnp.arange(q_len) + past,
        jnp.arange(kv_len),
        bidirectional=not is_decoder,
        max_distance=20,
    )
    chex.assert_shape(ours, (3, q_len, kv_len))
    np.testing.assert_array_equal(ours, expected)


class BatchedBiasTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_batched_positions_match_written_out_gather(self):
        # bias[b, h, i, j] = table[bucket(key[b, j] - query[b, i]), h], written out per entry.
        rng = np.random.default_rng(1)
        table = rng.normal(size=(8, 2)).astype(np.float32)
        query = np.array([[0, 1, 2], [40, 41, 42]], np.int32)
        key = np.array([[0, 1, 2, 3, 30], [0, 10, 20, 41, 60]], np.int32)
        bias = self.variant(lambda t, q, k: t5_relative_bias(t, q, k, max_distance=16))(
            jnp.asarray(table), jnp.asarray(query), jnp.asarray(key)
        )
        chex.assert_shape(bias, (2, 2, 3, 5))
        expected = np.zeros((2, 2, 3, 5), np.float32)
        for b, h, i, j in np.ndindex(expected.shape):
            bucket = t5_relative_position_bucket(
                jnp.int32(key[b, j] - query[b, i]), num_buckets=8, max_distance=16
            )
            expected[b, h, i, j] = table[int(bucket), h]
        np.testing.assert_array_equal(bias, expected)


def test_bias_keeps_table_dtype():
    table = jnp.ones((32, 4), jnp.bfloat16)
    bias = t5_relative_bias(table, jnp.arange(3), jnp.arange(5))
    chex.assert_type(bias, jnp.bfloat16)
    chex.assert_shape(bias, (4, 3, 5))


def test_relative_positions_broadcast_a_batch_of_one():
    out = relative_positions(jnp.array([[2, 3]]), jnp.array([[0, 1, 2], [5, 6, 7]]))
    np.testing.assert_array_equal(out, [[[-2, -1, 0], [-3, -2, -1]], [[3, 4, 5], [2, 3, 4]]])


@settings(max_examples=25, deadline=None)
@given(
    half_buckets=st.integers(2, 40),
    extra_distance=st.integers(1, 300),
    bidirectional=st.booleans(),
)
def test_buckets_in_range_and_monotone_in_distance(half_buckets, extra_distance, bidirectional):
    num_buckets = 2 * half_buckets
    max_exact = (half_buckets if bidirectional else num_buckets) // 2
    distances = np.arange(0, 2 * (max_exact + extra_distance) + 10, dtype=np.int32)
    kwargs = dict(
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_exact + extra_distance,
    )
    past = np.asarray(t5_relative_position_bucket(jnp.asarray(-distances), **kwargs))
    future = np.asarray(t5_relative_position_bucket(jnp.asarray(distances), **kwargs))
    for buckets in (past, future):
        assert buckets.min() >= 0 and buckets.max() < num_buckets
        assert np.all(np.diff(buckets) >= 0), "buckets must not decrease as |offset| grows"
    if bidirectional:
        assert past.max() < half_buckets <= future[1:].min()
    else:
        assert np.all(future == 0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_buckets": 33}, ValueError, "num_buckets must be even and >= 4 when bidir.*got 33"),
        ({"num_buckets": 2}, ValueError, "num_buckets must be even and >= 4 when bidir.*got 2"),
        ({"num_buckets": 1, "bidirectional": False}, ValueError, "num_buckets must be >= 2, got 1"),
        ({"num_buckets": 32.0}, TypeError, "num_buckets must be an int"),
        ({"max_distance": 8}, ValueError, "max_distance must be >= 9, got 8"),
        ({"bidirectional": 1}, TypeError, "bidirectional must be a bool, got int"),
    ],
)
def test_bucket_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        t5_relative_position_bucket(jnp.arange(3), **kwargs)


def test_bucket_rejects_float_offsets():
    with pytest.raises(TypeError, match="relative_position must have an integer dtype"):
        t5_relative_position_bucket(jnp.ones(3))


@pytest.mark.parametrize(
    ("table", "query", "key", "error", "match"),
    [
        (jnp.ones((32, 2), jnp.int32), jnp.arange(2), jnp.arange(2), TypeError,
         "table must have a floating dtype"),
        (jnp.ones((32,)), jnp.arange(2), jnp.arange(2), ValueError,
         r"table must have 2 dims \[num_buckets, heads\]"),
        (jnp.ones((31, 2)), jnp.arange(2), jnp.arange(2), ValueError,
         r"table.shape\[0\] \(num_buckets\) must be even and >= 4 when bidirectional, got 31"),
        (jnp.ones((32, 2)), jnp.arange(2.0), jnp.arange(2), TypeError,
         "query_positions must have an integer dtype"),
        (jnp.ones((32, 2)), jnp.arange(2), jnp.ones((1, 2), jnp.int32), ValueError,
         "must both be"),
        (jnp.ones((32, 2)), jnp.ones((2, 3), jnp.int32), jnp.ones((3, 3), jnp.int32), ValueError,
         r"query_positions batch \(2\) and key_positions batch \(3\) must be equal or 1"),
    ],
)
def test_bias_bad_arguments(table, query, key, error, match):
    with pytest.raises(error, match=match):
        t5_relative_bias(table, query, key)
