"""tfx.ops._scatter.set_dropping against `.at[index].set(mode="drop")`, and the reason it
exists: with a single update, XLA keeps its write a scatter (not a dynamic-update-slice)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compile_as_users_do

from tfx.ops._scatter import set_dropping

CACHE = (3, 2, 6, 4)  # [batch, heads, slots, dim], as KV caches are stored


def kv_write(batch: int, q_len: int, seed: int):
    """A cache, the rows/slots index of `tfx.ops.kv_cache.write` (slot 6: out of range, dropped)
    and new [batch, q_len, heads, dim] values."""
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.standard_normal(CACHE), jnp.float32)
    slots = jnp.asarray(rng.integers(0, CACHE[2] + 1, (batch, q_len)), jnp.int32)
    new = jnp.asarray(rng.standard_normal((batch, q_len, CACHE[1], CACHE[3])), jnp.float32)
    return cache, (jnp.arange(batch)[:, None], slice(None), slots), new


@pytest.mark.parametrize("batch,q_len,seed", [(1, 1, 0), (3, 1, 1), (2, 4, 2), (3, 6, 3)])
def test_kv_cache_index_equals_set_with_drop(batch, q_len, seed):
    cache, index, new = kv_write(batch, q_len, seed)
    chex.assert_trees_all_equal(set_dropping(cache, index, new),
                                cache.at[index].set(new, mode="drop"))


@pytest.mark.parametrize("slots", [[5], [0, 7, 3], [9, 9]])
def test_index_on_a_later_axis_equals_set_with_drop(slots):
    """The paged pools' form: [heads, slots, dim] written at [:, slots]."""
    pool = jnp.arange(2 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 3)
    slots = jnp.asarray(slots, jnp.int32)
    new = -jnp.ones((2, slots.shape[0], 3), jnp.float32)
    chex.assert_trees_all_equal(set_dropping(pool, (slice(None), slots), new, updates_axis=1),
                                pool.at[:, slots].set(new, mode="drop"))


def test_a_single_update_stays_a_scatter():
    cache, index, new = kv_write(1, 1, 0)
    ours = compile_as_users_do(jax.jit(lambda c, n: set_dropping(c, index, n)).lower(cache, new)
                               ).as_text()
    plain = jax.jit(lambda c, n: c.at[index].set(n, mode="drop")).lower(cache, new)
    assert "scatter" in ours and "dynamic-update-slice" not in ours
    assert "dynamic-update-slice" in compile_as_users_do(plain).as_text()  # XLA without it
