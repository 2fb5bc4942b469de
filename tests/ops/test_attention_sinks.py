"""Attention sinks (GPT-OSS): each head's softmax also counts a key of learned score s_h and
value zero. The reference and blocked kernels against the formula written out here, values
and gradients (the sinks' too)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops import dot_product_attention, sparse


def written_out(q, k, v, sinks, mask=None):
    """softmax over [q·k / sqrt(d) ..., s_h], the sink's column dropped, times v (GQA by
    repeating key heads)."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:3], 1))
    weights = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _inputs(seed=0, batch=2, q_len=9, kv_len=9, heads=4, kv_heads=2, dim=8):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (batch, q_len, heads, dim)),
            jax.random.normal(keys[1], (batch, kv_len, kv_heads, dim)),
            jax.random.normal(keys[2], (batch, kv_len, kv_heads, dim)),
            jax.random.normal(keys[3], (heads,)) + 1.0)


KERNELS = [dict(implementation="reference"),
           dict(implementation="blocked", block_sizes=(4, 4))]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k["implementation"])
def test_sinks_equal_the_written_out_softmax(kernel):
    q, k, v, sinks = _inputs()
    causal = jnp.tril(jnp.ones((9, 9), bool))
    got = dot_product_attention(q, k, v, sinks=sinks, is_causal=True, **kernel)
    chex.assert_trees_all_close(got, written_out(q, k, v, sinks, causal), atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k["implementation"])
def test_sink_gradients_equal_the_written_out_ones(kernel):
    q, k, v, sinks = _inputs(1)
    causal = jnp.tril(jnp.ones((9, 9), bool))
    weights = jax.random.normal(jax.random.key(9), (2, 9, 4, 8))

    def loss(fn):
        return jax.grad(lambda *x: jnp.sum(fn(*x) * weights), argnums=(0, 1, 2, 3))

    got = loss(lambda *x: dot_product_attention(*x[:3], sinks=x[3], is_causal=True, **kernel))
    want = loss(lambda *x: written_out(*x, causal))
    chex.assert_trees_all_close(got(q, k, v, sinks), want(q, k, v, sinks), atol=1e-5)


def test_a_row_that_sees_no_key_gives_all_weight_to_the_sink():
    q, k, v, sinks = _inputs(2)
    mask = jnp.ones((2, 1, 9, 9), bool).at[:, :, 3].set(False)
    for kernel in KERNELS:
        out = dot_product_attention(q, k, v, sinks=sinks, mask=mask, **kernel)
        chex.assert_trees_all_close(out[:, 3], jnp.zeros_like(out[:, 3]))
        chex.assert_trees_all_close(out, written_out(q, k, v, sinks, mask), atol=1e-5)


def test_sinks_with_a_strided_pattern_and_with_a_kv_cache():
    q, k, v, sinks = _inputs(3, q_len=16, kv_len=16)
    pattern = sparse.Strided(stride=4)  # without sinks, blocked runs it in two merged pieces
    dense = jnp.asarray(pattern.dense(16, 16))
    got = dot_product_attention(q, k, v, sinks=sinks, sparsity=pattern, implementation="blocked")
    chex.assert_trees_all_close(got, written_out(q, k, v, sinks, dense), atol=1e-5)
    cached = dot_product_attention(q[:, -2:], *(jnp.swapaxes(x, 1, 2) for x in (k, v)),
                                   sinks=sinks, heads_major=True)
    chex.assert_trees_all_close(cached, written_out(q[:, -2:], k, v, sinks), atol=1e-5)


def test_kernels_without_sinks_refuse_them_by_name():
    q, k, v, sinks = _inputs()
    with pytest.raises(ValueError, match=r"implementation='splash' cannot run .*no sinks"):
        dot_product_attention(q, k, v, sinks=sinks, implementation="splash")
    with pytest.raises(ValueError, match=r"sinks must be \[num_heads\] = \(4,\), got \(2,\)"):
        dot_product_attention(q, k, v, sinks=sinks[:2])


@pytest.mark.parametrize("implementation", ["reference", "blocked"])
def test_paged_attention_with_sinks_equals_cached_attention(implementation):
    """Pages of 64 tokens: the blocked kernel runs two blocks of pages (its online softmax
    starts from the sink); a padding query (position -1) sees nothing and gives zeros."""
    from tfx.ops.attention.paged import gather_pages, paged_attention

    q, k, v, sinks = _inputs(4, q_len=3, kv_len=256)
    pool = [jnp.swapaxes(x, 1, 2).reshape(2, 2, 4, 64, 8).transpose(1, 0, 2, 3, 4)
            .reshape(2, 8, 64, 8) for x in (k, v)]  # sequence b's page p is pool page 4b + p
    table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    positions = jnp.asarray([[200, 201, 202], [70, 71, -1]], jnp.int32)
    out = paged_attention(q, *pool, table, positions, sinks=sinks, implementation=implementation)
    mask = jnp.arange(256)[None, None, None, :] <= positions[:, None, :, None]
    dense = [gather_pages(x, table) for x in pool]
    expected = dot_product_attention(q, *dense, mask=mask, sinks=sinks, heads_major=True)
    chex.assert_trees_all_close(out, expected, atol=1e-5)
    chex.assert_trees_all_close(out[1, 2], jnp.zeros_like(out[1, 2]))
    np.testing.assert_array_equal(dense[0], jnp.swapaxes(k, 1, 2))  # the pages hold k


def test_paged_pallas_kernels_refuse_sinks_by_name():
    from tfx.ops.attention.paged import paged_attention

    q, k, v, sinks = _inputs(5, q_len=1, kv_len=16)
    pool = [jnp.swapaxes(x, 1, 2).reshape(2, 2, 1, 16, 8).transpose(1, 0, 2, 3, 4)
            .reshape(2, 2, 16, 8) for x in (k, v)]
    table, positions = jnp.asarray([[0], [1]], jnp.int32), jnp.asarray([[15], [15]], jnp.int32)
    with pytest.raises(ValueError, match=r"'pallas_gpu' cannot run this call.*no sinks"):
        paged_attention(q, *pool, table, positions, sinks=sinks, implementation="pallas_gpu")
    with pytest.raises(ValueError, match=r"sinks must be \[num_heads\] = \(4,\)"):
        paged_attention(q, *pool, table, positions, sinks=sinks[:3])
