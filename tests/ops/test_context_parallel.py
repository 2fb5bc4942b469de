"""The static side of context parallelism, on one device: which chunk pairs compute and with
which tile plan (checked against the dense mask written out by the spec), the causal load
balance of the zigzag split, the exchange chosen by size, and the errors raised before any
work. Values and gradients on 8 devices: tests/parallel/test_context_parallel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from tfx.ops import backends
from tfx.ops.attention.context_parallel import (
    context_parallel_attention,
    pair_plans,
    split_sequence,
)
from tfx.ops.sparse import Causal, RandomBlocks, SlidingWindow, Strided


@pytest.mark.parametrize("spec", [None, Causal(), SlidingWindow(10), Causal() & Strided(7)])
@pytest.mark.parametrize(("num_chunks", "chunk_len"), [(8, 8), (4, 12)])
def test_pairs_compute_exactly_where_the_dense_mask_has_a_visible_pair(spec, num_chunks,
                                                                       chunk_len):
    total = num_chunks * chunk_len
    dense = np.ones((total, total), bool) if spec is None else spec.dense(total, total)
    plans, table = pair_plans(spec, num_chunks, chunk_len, 4, 4)
    for a in range(num_chunks):
        for b in range(num_chunks):
            tile = dense[a * chunk_len:(a + 1) * chunk_len, b * chunk_len:(b + 1) * chunk_len]
            assert (table[a, b] > 0) == tile.any(), (a, b)
            if table[a, b]:  # the pair's plan visits every tile holding a visible pair
                plan = plans[table[a, b] - 1]
                blocks = tile.reshape(chunk_len // 4, 4, chunk_len // 4, 4).any(axis=(1, 3))
                for row, visible in enumerate(blocks):
                    visited = set(plan.key_blocks[row, :plan.visits[row]].tolist())
                    assert visited == set(np.flatnonzero(visible).tolist())


def test_identical_pair_plans_are_compiled_once():
    plans, table = pair_plans(Causal(), 16, 32, 8, 8)
    assert len(plans) == 2  # the diagonal and the fully visible pair
    diagonal, below = table[0, 0], table[1, 0]
    assert diagonal != below and (np.diag(table) == diagonal).all()
    assert (table[np.tril_indices(16, -1)] == below).all()
    assert (table[np.triu_indices(16, 1)] == 0).all()


def _work(table, plans, chunk_ids) -> int:
    """Tiles one device computes over all steps: its query chunks against every key chunk."""
    return sum(plans[table[a, b] - 1].num_tiles for a in chunk_ids
               for b in range(table.shape[1]) if table[a, b])


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_zigzag_gives_every_device_the_same_causal_work(devices):
    plans, table = pair_plans(Causal(), 2 * devices, 64, 16, 16)
    zigzag = [_work(table, plans, (d, 2 * devices - 1 - d)) for d in range(devices)]
    assert len(set(zigzag)) == 1, zigzag
    plans, table = pair_plans(Causal(), devices, 128, 16, 16)
    contiguous = [_work(table, plans, (d,)) for d in range(devices)]
    assert contiguous[-1] > 2 * contiguous[0]  # what the zigzag avoids


def test_too_many_distinct_plans_are_refused():
    with pytest.raises(ValueError, match=r"needs 26 distinct tile plans over 32 sequence "
                                         r"chunks \(at most 16\)"):
        pair_plans(RandomBlocks(4, 1), 32, 3, 1, 1)


def test_exchange_by_ring_size_and_key_value_bytes():
    assert backends.select_context_exchange(2, 2**30) == "all_gather"
    assert backends.select_context_exchange(8, backends.ALL_GATHER_MAX_BYTES) == "all_gather"
    assert backends.select_context_exchange(8, backends.ALL_GATHER_MAX_BYTES + 1) == "ring"


MESH = AbstractMesh((4,), ("sequence",))


def _qkv(seq=32, kv_seq=None, heads=(4, 2)):
    query = jnp.zeros((2, seq, heads[0], 8))
    key = jnp.zeros((2, kv_seq or seq, heads[1], 8))
    return query, key, key


@pytest.mark.parametrize(("kwargs", "qkv", "message"), [
    (dict(mesh=AbstractMesh((4,), ("data",))), {}, r"mesh has no axis 'sequence'"),
    (dict(spec=Causal()), dict(seq=36), r"length 36 must be divisible by 8 chunks over 4 "
                                        r"devices \(2 per device"),
    ({}, dict(seq=30), r"length 30 must be divisible by 4 chunks over 4 devices\n"),
    ({}, dict(kv_seq=64), r"key length 64 must equal query length 32"),
    (dict(exchange="mesh"), {}, r"exchange must be one of \('ring', 'all_gather'\)"),
])
def test_bad_arguments_raise_before_any_work(kwargs, qkv, message):
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(*_qkv(**qkv), **{"mesh": MESH, **kwargs})


def test_split_sequence_leaves_arrays_alone_without_a_sequence_axis():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    assert split_sequence(x) is x
    with jax.sharding.use_abstract_mesh(MESH):
        jaxpr = str(jax.make_jaxpr(split_sequence)(jnp.zeros((2, 8, 4))))
        assert "sharding_constraint" in jaxpr and "sequence" in jaxpr
        assert "sharding_constraint" not in str(jax.make_jaxpr(split_sequence)(x))  # 3 ∤ 4
