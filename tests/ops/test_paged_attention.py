"""Paged KV cache ops: slots from the page table, writes, and paged attention (reference, blocked,
and jax's Pallas GPU kernel in interpret mode) against dense causal attention written out here
over each sequence's keys gathered by hand."""

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops import backends
from tfx.ops.attention.paged import BLOCK_TOKENS, paged_attention
from tfx.ops.paged import PagedKV, init_paged_cache, write_pages


def _dense_causal(query, key_pages, value_pages, page_table, positions, scale, softcap=None):
    """Reference: per sequence, its keys in logical order (page_table[b, p // S], p % S), and
    softmax over positions 0..p for a query at p (zeros for p < 0); query head h reads key
    head h // (num_heads / num_kv_heads)."""
    batch, q_len, num_heads, _ = query.shape
    num_kv_heads, _, page_size, value_dim = value_pages.shape
    out = np.zeros((batch, q_len, num_heads, value_dim), np.float64)
    for b in range(batch):
        for t in range(q_len):
            p = positions[b, t]
            if p < 0:
                continue
            logical = np.arange(p + 1)
            pages, offsets = page_table[b, logical // page_size], logical % page_size
            for h in range(num_heads):
                k = h // (num_heads // num_kv_heads)
                scores = key_pages[k, pages, offsets] @ query[b, t, h] * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                weights = np.exp(scores - scores.max())
                out[b, t, h] = weights / weights.sum() @ value_pages[k, pages, offsets]
    return out


def _case(seed=0, batch=3, q_len=4, num_heads=4, num_kv_heads=2, head_dim=16, num_pages=14,
          page_size=4, pages_per_seq=4):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(batch, q_len, num_heads, head_dim)).astype(np.float32)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    key_pages, value_pages = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    # Random, disjoint pages per sequence; the last logical page of row 2 unassigned (-1).
    page_table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, -1)
    page_table[2, -1] = -1
    capacity = pages_per_seq * page_size
    # Partial last pages, padding queries (-1), a row that only pads, chunks across pages.
    starts = [capacity - q_len, 5, None]
    positions = np.full((batch, q_len), -1)
    for b, start in enumerate(starts):
        if start is not None:
            positions[b, :q_len - b] = np.arange(start, start + q_len - b)
    return query, key_pages, value_pages, page_table.astype(np.int32), positions.astype(np.int32)


@pytest.mark.parametrize("implementation", ["reference", "blocked"])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_paged_attention_equals_dense_causal_attention(implementation, num_kv_heads):
    query, keys, values, table, positions = _case(num_kv_heads=num_kv_heads)
    out = paged_attention(*map(jnp.asarray, (query, keys, values, table, positions)),
                          implementation=implementation)
    assert out.shape == (3, 4, 4, 16) and out.dtype == jnp.float32
    expected = _dense_causal(query, keys, values, table, positions, 16 ** -0.5)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[2], 0.0)  # a row of padding queries


def test_blocked_over_several_blocks_of_pages_and_a_padded_last_block():
    # 40 pages of 4 tokens: blocks of BLOCK_TOKENS // 4 = 32 pages, the second one padded.
    assert BLOCK_TOKENS < 40 * 4 and 40 % (BLOCK_TOKENS // 4)
    query, keys, values, table, positions = _case(seed=2, num_pages=130, pages_per_seq=40)
    out = paged_attention(*map(jnp.asarray, (query, keys, values, table, positions)),
                          implementation="blocked")
    expected = _dense_causal(query, keys, values, table, positions, 16 ** -0.5)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("implementation", ["reference", "blocked"])
def test_scale_and_softcap(implementation):
    query, keys, values, table, positions = _case(seed=1)
    out = paged_attention(*map(jnp.asarray, (query, keys, values, table, positions)),
                          scale=0.5, softcap=2.0, implementation=implementation)
    expected = _dense_causal(query, keys, values, table, positions, 0.5, softcap=2.0)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


def test_pallas_gpu_kernel_decoding_step_in_interpret_mode():
    # jax's Pallas GPU kernel, run by the Pallas interpreter on CPU (no GPU here): one query
    # per sequence, page_size 16 as the kernel needs.
    query, keys, values, table, positions = _case(q_len=1, page_size=16, pages_per_seq=2)
    positions = np.array([[20], [0], [-1]], np.int32)
    out = paged_attention(*map(jnp.asarray, (query, keys, values, table, positions)),
                          implementation="pallas_gpu")
    expected = _dense_causal(query, keys, values, table, positions, 16 ** -0.5)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


def test_backend_selection():
    def case(q_len, page_size=16, head_dim=64, pages_per_seq=8):
        return backends.PagedCase(q_len=q_len, pages_per_seq=pages_per_seq, page_size=page_size,
                                  head_dim=head_dim, value_dim=head_dim, dtype=np.float32)

    assert backends.select_paged_attention("cuda", case(1)) == "pallas_gpu"
    assert backends.select_paged_attention("gpu", case(64)) == "blocked"  # a prefill chunk
    assert backends.select_paged_attention("gpu", case(1, head_dim=8)) == "blocked"
    assert backends.select_paged_attention("tpu", case(1, page_size=128)) == "pallas_tpu"
    assert backends.select_paged_attention("tpu", case(1, page_size=16)) == "blocked"
    assert backends.select_paged_attention("cpu", case(1)) == "blocked"


def test_plan_and_write_place_tokens_by_page_table():
    cache = init_paged_cache(num_layers=1, num_pages=6, page_size=2, batch=2, pages_per_seq=3,
                             num_kv_heads=1, head_dim=1)
    table = jnp.asarray([[4, 1, -1], [0, 5, 2]], jnp.int32)
    cache = dataclasses.replace(cache, page_table=table,
                                next_position=jnp.asarray([1, 4], jnp.int32))
    valid = jnp.asarray([[True, True, True], [True, False, False]])
    step, cache = cache.plan(valid)
    # Row 0: positions 1, 2, 3 -> page 4 offset 1, page 1 offsets 0 and 1; row 1: position 4
    # -> page 2 offset 0; padding -> 12 (out of the 6 * 2 slots: dropped).
    chex.assert_trees_all_equal(step.slots, jnp.asarray([[9, 2, 3], [4, 12, 12]]))
    chex.assert_trees_all_equal(step.query_positions, jnp.asarray([[1, 2, 3], [4, -1, -1]]))
    chex.assert_trees_all_equal(cache.next_position, jnp.asarray([4, 5]))
    new = jnp.arange(1.0, 7.0).reshape(2, 3, 1, 1)
    layer = write_pages(cache.layers[0], new, -new, step)
    flat = np.asarray(layer.key).reshape(-1)
    np.testing.assert_array_equal(flat[[9, 2, 3, 4]], [1, 2, 3, 4])
    assert np.count_nonzero(flat) == 4 and np.array_equal(layer.value, -layer.key)


def test_tokens_past_the_page_table_or_on_no_page_are_not_stored():
    cache = init_paged_cache(num_layers=1, num_pages=2, page_size=2, batch=1, pages_per_seq=2,
                             num_kv_heads=1, head_dim=1)
    cache = dataclasses.replace(cache, page_table=jnp.asarray([[1, -1]], jnp.int32),
                                next_position=jnp.asarray([1], jnp.int32))
    step, _ = cache.plan(jnp.ones((1, 4), bool))  # positions 1 (page 1), 2, 3 (no page), 4
    np.testing.assert_array_equal(step.slots, [[3, 4, 4, 4]])


def test_argument_checks():
    query, keys, values, table, positions = map(jnp.asarray, _case())
    with pytest.raises(ValueError, match="query must have 4 dims"):
        paged_attention(query[0], keys, values, table, positions)
    with pytest.raises(ValueError, match="num_kv_heads >= 1 dividing num_heads"):
        paged_attention(query[:, :, :3], keys, values, table, positions)
    with pytest.raises(ValueError, match="head_dim=16"):
        paged_attention(query, keys[..., :8], values, table, positions)
    with pytest.raises(ValueError, match="page_table must be"):
        paged_attention(query, keys, values, table[:2], positions)
    with pytest.raises(ValueError, match="query_positions must be"):
        paged_attention(query, keys, values, table, positions[:, :2])
    with pytest.raises(TypeError, match="page_table must have an integer dtype"):
        paged_attention(query, keys, values, table.astype(jnp.float32), positions)
    with pytest.raises(ValueError, match="implementation must be one of"):
        paged_attention(query, keys, values, table, positions, implementation="cudnn")
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_attention(query, keys, values, table, positions, implementation="pallas_gpu")
    with pytest.raises(ValueError, match="platform tpu"):
        paged_attention(query[:, :1], keys, values, table, positions[:, :1],
                        implementation="pallas_tpu")
    with pytest.raises(ValueError, match="softcap must be > 0"):
        paged_attention(query, keys, values, table, positions, softcap=-1.0)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        init_paged_cache(num_layers=1, num_pages=2, page_size=0, batch=1, pages_per_seq=2,
                         num_kv_heads=1, head_dim=1)
    assert isinstance(init_paged_cache(num_layers=2, num_pages=2, page_size=2, batch=1,
                                       pages_per_seq=2, num_kv_heads=1, head_dim=1,
                                       stacked=True).layers, PagedKV)
