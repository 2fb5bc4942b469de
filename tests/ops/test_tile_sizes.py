"""The blocked kernel's tile choice: the least modelled cost, written out here from the dense
mask, and the values and gradients of attention with the chosen tiles against the reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops import dot_product_attention, sparse
from tfx.ops.attention.blocked_attention import BLOCK_K, BLOCK_Q
from tfx.ops.attention.tile_sizes import PAIR_COST, choose_block_sizes

BIGBIRD = sparse.SlidingWindow(192) | sparse.GlobalTokens(64) | sparse.RandomBlocks(64, 3)
DEFAULT = (BLOCK_Q, BLOCK_K)
SPECS = [sparse.Causal(), sparse.SlidingWindow(256), sparse.Strided(128), BIGBIRD,
         sparse.Causal() & sparse.GlobalTokens(16)]


def _visited_tiles(mask: np.ndarray, block_q: int, block_k: int) -> int:
    """Tiles of the dense mask holding a visible pair (partial last tiles included)."""
    q_len, kv_len = mask.shape
    return sum(mask[r:r + block_q, k:k + block_k].any()
               for r in range(0, q_len, block_q) for k in range(0, kv_len, block_k))


@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("q_len, kv_len", [(1024, 1024), (700, 1300), (2048, 2048)])
def test_choice_is_the_least_modelled_cost(spec, q_len, kv_len):
    mask = spec.dense(q_len, kv_len)
    costs = []
    for (block_q, block_k), weight in PAIR_COST.items():
        block_q, block_k = min(block_q, q_len), min(block_k, kv_len)
        tiles = _visited_tiles(mask, block_q, block_k)
        costs.append((tiles * block_q * block_k * weight, (block_q, block_k)))
    expected = min(costs, key=lambda c: c[0])[1]  # the first of equal costs: the default tiles
    assert choose_block_sizes(spec, q_len, kv_len) == expected


def test_without_a_static_mask_the_default_tiles_capped_at_the_lengths():
    assert choose_block_sizes(None, 4096, 4096) == DEFAULT
    assert choose_block_sizes(None, 100, 300) == (100, 300)


def test_bigbird_tiles_visit_about_the_pairs_it_keeps():
    # With 256 x 512 tiles BigBird's scattered 64-key blocks fill a small share of each visited
    # tile; the chosen tiles visit less than twice the pairs the pattern keeps.
    n = 4096
    mask = BIGBIRD.dense(n, n)
    block_q, block_k = choose_block_sizes(BIGBIRD, n, n)
    visited = _visited_tiles(mask, block_q, block_k) * block_q * block_k
    default = _visited_tiles(mask, *DEFAULT) * DEFAULT[0] * DEFAULT[1]
    assert visited < 2 * mask.sum() < default / 3


def test_attention_with_the_chosen_tiles_equals_the_reference():
    n = 320
    spec = sparse.SlidingWindow(40) | sparse.GlobalTokens(8) | sparse.RandomBlocks(64, 1)
    assert choose_block_sizes(spec, n, n) == (64, 64)
    keys = jax.random.split(jax.random.key(0), 3)
    query, key, value = (jax.random.normal(k, (2, n, 4, 16)) for k in keys)

    def run(implementation):
        def loss(q, k, v):
            out = dot_product_attention(q, k, v, sparsity=spec, implementation=implementation)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(query, key, value)

    chex.assert_trees_all_close(run("blocked"), run("reference"), atol=2e-5, rtol=2e-5)
