"""The blocked (flash-style) kernel against the reference path, which is itself checked against
jax.nn.dot_product_attention and a written-out formula in test_attention.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compile_as_users_do
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops import dot_product_attention, sparse
from tfx.ops.attention.block_plan import block_plan
from tfx.ops.masks import length_mask

SPECS = [
    None,
    sparse.SlidingWindow(5),
    sparse.Strided(4),
    sparse.Fixed(6, 2),
    sparse.GlobalTokens(3) | sparse.SlidingWindow(3),
    sparse.RandomBlocks(4, 2, seed=1),
]


def _inputs(seed, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    query = jax.random.normal(keys[0], (batch, q_len, num_heads, head_dim), dtype)
    key = jax.random.normal(keys[1], (batch, kv_len, num_kv_heads, head_dim), dtype)
    value = jax.random.normal(keys[2], (batch, kv_len, num_kv_heads, head_dim), dtype)
    return query, key, value


def _both(query, key, value, bias=None, **kwargs):
    """Outputs and gradients (query, key, value, bias) of both implementations."""

    def run(implementation):
        def loss(q, k, v, b):
            out = dot_product_attention(q, k, v, bias=b, implementation=implementation, **kwargs)
            return jnp.sum(out * jnp.cos(out)), out

        # Jitted whole: one compilation per case, rather than the backward's and the loss's
        # ops compiled one by one for each new shape.
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        grads, out = step(query, key, value, bias)
        return out, grads

    return run("blocked"), run("reference")


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 2),
    q_len=st.integers(1, 23),
    kv_len=st.integers(1, 23),
    num_kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    block_q=st.integers(1, 9),
    block_k=st.integers(1, 9),
    is_causal=st.booleans(),
    spec=st.sampled_from(SPECS),
    with_mask=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_blocked_equals_reference(batch, q_len, kv_len, num_kv_heads, group, block_q, block_k,
                                  is_causal, spec, with_mask, with_bias, seed):
    query, key, value = _inputs(seed, batch, q_len, kv_len, num_kv_heads * group, num_kv_heads, 4)
    rng = np.random.default_rng(seed)
    mask = jnp.asarray(rng.random((batch, 1, q_len, kv_len)) < 0.7) if with_mask else None
    bias = jnp.asarray(rng.normal(size=(1, num_kv_heads * group, q_len, kv_len)),
                       jnp.float32) if with_bias else None
    blocked, reference = _both(query, key, value, bias, mask=mask, is_causal=is_causal,
                               sparsity=spec, block_sizes=(block_q, block_k))
    chex.assert_trees_all_close(blocked, reference, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa_causal_cross_attention(num_heads, num_kv_heads, is_causal):
    query, key, value = _inputs(0, 2, 37, 53, num_heads, num_kv_heads, 16)
    bias = jax.random.normal(jax.random.key(1), (2, 1, 37, 1))  # broadcast along heads and keys
    blocked, reference = _both(query, key, value, bias, is_causal=is_causal, block_sizes=(16, 8))
    chex.assert_trees_all_close(blocked, reference, atol=2e-5, rtol=2e-5)


def test_segment_ids_equal_the_segment_mask():
    query, key, value = _inputs(2, 2, 30, 30, 4, 2, 8)
    segments = jnp.array([[0] * 9 + [1] * 13 + [2] * 8, [5] * 30])
    blocked, reference = _both(query, key, value, query_segment_ids=segments, is_causal=True,
                               block_sizes=(8, 8))
    chex.assert_trees_all_close(blocked, reference, atol=2e-5, rtol=2e-5)


def test_cross_attention_segment_ids():
    query, key, value = _inputs(3, 1, 12, 20, 2, 1, 8)
    q_segments = jnp.array([[0] * 5 + [1] * 7])
    k_segments = jnp.array([[0] * 8 + [1] * 12])
    blocked, reference = _both(query, key, value, query_segment_ids=q_segments,
                               key_segment_ids=k_segments, block_sizes=(4, 4))
    chex.assert_trees_all_close(blocked, reference, atol=2e-5, rtol=2e-5)


def test_bfloat16():
    query, key, value = _inputs(4, 2, 40, 40, 4, 2, 32, jnp.bfloat16)
    kwargs = {"is_causal": True, "block_sizes": (16, 16)}
    blocked = dot_product_attention(query, key, value, implementation="blocked", **kwargs)
    reference = dot_product_attention(query, key, value, implementation="reference", **kwargs)
    assert blocked.dtype == jnp.bfloat16
    chex.assert_trees_all_close(blocked.astype(jnp.float32), reference.astype(jnp.float32),
                                atol=2e-2, rtol=2e-2)
    grads = jax.grad(lambda q: jnp.sum(dot_product_attention(
        q, key, value, implementation="blocked", **kwargs).astype(jnp.float32)))(query)
    assert grads.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(grads)))


def test_fully_masked_rows_are_zero_with_finite_gradients():
    query, key, value = _inputs(5, 2, 10, 12, 2, 2, 8)
    mask = length_mask(jnp.array([0, 7]), 12)
    (out, grads), _ = _both(query, key, value, mask=mask, block_sizes=(4, 4))
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads if g is not None)


class TestSkippedTilesAreNeverRead:
    """A NaN in a value row reaches the output if its tile is computed at all, even when fully
    masked (0 · NaN = NaN in P·V), so finite results prove that the tile was skipped."""

    def setup_method(self):
        self.query, self.key, value = _inputs(6, 1, 64, 64, 2, 1, 8)
        self.value = value.at[:, 48:].set(jnp.nan)  # key blocks 6 and 7 of 8

    def _attend(self, query, key, value, **kwargs):
        return dot_product_attention(query, key, value, implementation="blocked",
                                     block_sizes=(8, 8), **kwargs)

    def test_causal_skips_future_blocks(self):
        out = self._attend(self.query, self.key, self.value, is_causal=True)
        assert bool(jnp.all(jnp.isfinite(out[:, :48])))
        assert bool(jnp.all(jnp.isnan(out[:, 48:])))  # the poison does reach where it should

    def test_sliding_window_skips_distant_blocks(self):
        value = self.value.at[:, 48:].set(0.0).at[:, :8].set(jnp.nan)
        out = self._attend(self.query, self.key, value, sparsity=sparse.SlidingWindow(8))
        assert bool(jnp.all(jnp.isfinite(out[:, 16:])))

    def test_padding_skips_empty_tiles_forward_and_backward(self):
        mask = length_mask(jnp.array([48]), 64)
        grads = jax.grad(lambda q, k, v: jnp.sum(self._attend(q, k, v, mask=mask)),
                         argnums=(0, 1))(self.query, self.key, self.value)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)

    def test_segments_skip_tiles_where_no_segments_meet(self):
        segments = jnp.array([[0] * 48 + [1] * 16])
        out = self._attend(self.query, self.key, self.value, query_segment_ids=segments)
        assert bool(jnp.all(jnp.isfinite(out[:, :48])))


def test_plan_work_scales_with_the_pattern():
    """Tiles computed per (batch, head): causal about half of full, a window O(N·w)."""
    n, block = 8192, 256
    full = block_plan(None, n, n, block, block).num_tiles
    causal = block_plan(sparse.Causal(), n, n, block, block).num_tiles
    window = block_plan(sparse.SlidingWindow(256), n, n, block, block).num_tiles
    assert full == (n // block) ** 2
    assert causal == (n // block) * (n // block + 1) // 2
    assert window == 2 * (n // block) - 1
    double = block_plan(sparse.SlidingWindow(256), 2 * n, 2 * n, block, block).num_tiles
    assert double == 2 * (2 * n // block) - 1  # linear in N


def test_plan_tiles_reproduce_the_dense_mask():
    spec = sparse.Strided(5) | sparse.GlobalTokens(2)
    q_len, kv_len, block_q, block_k = 29, 31, 8, 6
    plan = block_plan(spec, q_len, kv_len, block_q, block_k)
    rebuilt = np.zeros((plan.visits.size * block_q, -(-kv_len // block_k) * block_k), bool)
    for qb in range(plan.visits.size):
        for i in range(plan.visits[qb]):
            kb = plan.key_blocks[qb, i]
            tile = plan.tile_masks[plan.tile_mask_ids[qb, i]]
            rebuilt[qb * block_q:(qb + 1) * block_q, kb * block_k:(kb + 1) * block_k] = tile
        assert np.all(plan.tile_mask_ids[qb, : plan.full_visits[qb]] == 0)
    np.testing.assert_array_equal(rebuilt[:q_len, :kv_len], spec.dense(q_len, kv_len))
    assert not rebuilt[:, kv_len:].any()


def _temp_bytes(implementation, n):
    shape = jax.ShapeDtypeStruct((1, n, 4, 64), jnp.float32)
    grad = jax.jit(jax.grad(functools.partial(
        lambda q, k, v, impl: jnp.sum(dot_product_attention(q, k, v, is_causal=True,
                                                            implementation=impl)),
        impl=implementation), argnums=(0, 1, 2)))
    compiled = compile_as_users_do(grad.lower(shape, shape, shape))
    return compiled.memory_analysis().temp_size_in_bytes


def test_forward_backward_memory_is_linear_in_sequence_length():
    """XLA's own accounting of the compiled forward+backward: the blocked path's scratch grows
    like N (the reference path's like N², shown for contrast)."""
    small, large = _temp_bytes("blocked", 4096), _temp_bytes("blocked", 16384)
    assert large < 5 * small  # 4x the length: linear is 4x, quadratic would be 16x
    assert large < 64 * 16384 * 4 * 64  # tens of bytes per (position, head, feature)
    reference_small = _temp_bytes("reference", 1024)
    reference_large = _temp_bytes("reference", 2048)
    assert reference_large > 3.5 * reference_small


def test_automatic_choice():
    def uses_loops(n):
        query, key, value = _inputs(0, 1, n, n, 1, 1, 8)
        jaxpr = jax.make_jaxpr(lambda q, k, v: dot_product_attention(q, k, v))(query, key, value)
        return "while" in str(jaxpr)

    assert not uses_loops(64)
    assert uses_loops(1024)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"block_sizes": 8}, TypeError, r"block_sizes must be a \(block_q, block_k\) tuple"),
        ({"block_sizes": (8, 0)}, ValueError, r"block_sizes\[1\] \(block_k\) must be >= 1"),
        ({"query_segment_ids": jnp.zeros((2, 5), jnp.int32)}, ValueError,
         r"query_segment_ids of shape \(2, 5\) must be \[batch, q_len\] = \(2, 6\)"),
        ({"query_segment_ids": jnp.zeros((2, 6))}, TypeError,
         "query_segment_ids must have an integer dtype"),
        ({"key_segment_ids": jnp.zeros((2, 6), jnp.int32)}, ValueError,
         "key_segment_ids needs query_segment_ids"),
    ],
)
def test_bad_input(kwargs, error, match):
    query, key, value = _inputs(0, 2, 6, 6, 2, 1, 4)
    with pytest.raises(error, match=match):
        dot_product_attention(query, key, value, implementation="blocked", **kwargs)
