"""`tfx.ops.dot_product_attention` of one example [q_len, heads, dim], as
`jax.nn.dot_product_attention` takes it, so a per-example function vmaps."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

from tfx.ops import dot_product_attention


def _qkv(key, q_len=5, kv_len=7, heads=4, kv_heads=2, dim=8):
    q, k, v = jax.random.split(key, 3)
    return (jax.random.normal(q, (q_len, heads, dim)),
            jax.random.normal(k, (kv_len, kv_heads, dim)),
            jax.random.normal(v, (kv_len, kv_heads, dim)))


@pytest.mark.parametrize("implementation", ["reference", "blocked"])
def test_one_example_equals_jax_nn(implementation):
    query, key, value = _qkv(jax.random.key(0), q_len=6, kv_len=6)
    mask = jax.random.bernoulli(jax.random.key(1), 0.8, (4, 6, 6)).at[:, :, 0].set(True)
    bias = jax.random.normal(jax.random.key(2), (4, 6, 6))
    for kwargs in ({}, {"mask": mask, "bias": bias}, {"is_causal": True}):
        out = dot_product_attention(query, key, value, implementation=implementation,
                                    **kwargs)
        chex.assert_shape(out, (6, 4, 8))
        chex.assert_trees_all_close(
            out, jax.nn.dot_product_attention(query, key, value, **kwargs), atol=2e-6)


def test_vmap_over_a_per_example_function_equals_the_batched_call():
    batch = [_qkv(jax.random.key(i)) for i in range(3)]
    query, key, value = (jnp.stack(xs) for xs in zip(*batch, strict=True))
    ids = jnp.array([[0, 0, 1, 1, 1, 1, 1]] * 3)

    def one(q, k, v, i):
        return dot_product_attention(q, k, v, query_segment_ids=i[:5], key_segment_ids=i)

    chex.assert_trees_all_close(
        jax.vmap(one)(query, key, value, ids),
        dot_product_attention(query, key, value, query_segment_ids=ids[:, :5],
                              key_segment_ids=ids), atol=1e-6)


def test_one_example_needs_matching_ranks():
    query, key, value = _qkv(jax.random.key(0))
    with pytest.raises(ValueError, match=r"key must have 3 dims like query"):
        dot_product_attention(query, key[None], value)
    with pytest.raises(ValueError, match=r"query_segment_ids of one example must be 1-D"):
        dot_product_attention(query, key, value, query_segment_ids=jnp.zeros((1, 5), int))
