"""Residue order and the strided pattern split in two: token moves and the strided part's mask
written out with numpy, and attention over the two pieces against the reference path."""

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tfx.ops.attention.blocked
from tfx.ops import dot_product_attention, sparse
from tfx.ops.attention.blocked_attention import ScoreInputs
from tfx.ops.attention.blocked_pieces import Piece, pieced_attention
from tfx.ops.attention.residue_order import (
    StridedHistory,
    from_residue_order,
    strided_parts,
    to_residue_order,
)
from tfx.ops.attention.tile_sizes import choose_pieces, strided_pieces, visited_pairs


def _order(length: int, stride: int) -> np.ndarray:
    """Token at each residue-order slot (-1: padding), written out: residue 0's tokens first,
    then residue 1's, ..."""
    per_residue = -(-length // stride)
    slots = [r + a * stride for r in range(stride) for a in range(per_residue)]
    return np.array([t if t < length else -1 for t in slots])


@pytest.mark.parametrize("length, stride, axis", [(12, 4, 0), (13, 4, 1), (5, 8, 0), (7, 1, 1)])
def test_tokens_move_to_their_residue_and_back(length, stride, axis):
    x = np.arange(1, length + 1)  # token t holds t + 1; padding holds 0
    x = np.stack([x, -x], axis=1 - axis)  # a second dim, so that `axis` matters
    moved = np.asarray(to_residue_order(jnp.asarray(x), axis, stride))
    order = _order(length, stride) if stride > 1 else np.arange(length)
    expected = np.where(order >= 0, order + 1, 0)
    np.testing.assert_array_equal(np.moveaxis(moved, axis, 0)[:, 0], expected)
    np.testing.assert_array_equal(from_residue_order(jnp.asarray(moved), axis, stride, length), x)


@pytest.mark.parametrize("q_len, kv_len, stride", [(16, 16, 4), (13, 19, 3), (9, 5, 4)])
def test_strided_history_is_the_strided_part_in_residue_order(q_len, kv_len, stride):
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    strided_part = (i - j >= stride) & ((i - j) % stride == 0)  # Strided(s) minus its window
    rows, cols = _order(q_len, stride), _order(kv_len, stride)
    expected = np.zeros((rows.size, cols.size), dtype=bool)
    real = (rows[:, None] >= 0) & (cols[None, :] >= 0)
    expected[real] = strided_part[np.broadcast_to(rows[:, None], real.shape)[real],
                                  np.broadcast_to(cols[None, :], real.shape)[real]]
    found = StridedHistory(stride, q_len, kv_len).dense(rows.size, cols.size)
    # Padded query slots may see anything (their rows are dropped); padded keys never.
    np.testing.assert_array_equal(found[rows >= 0], expected[rows >= 0])
    assert not found[:, cols < 0].any()
    window = sparse.SlidingWindow(stride).dense(q_len, kv_len)
    assert not (window & strided_part).any()
    np.testing.assert_array_equal(window | strided_part,
                                  sparse.Strided(stride).dense(q_len, kv_len))


def test_strided_parts():
    assert strided_parts(sparse.Strided(8)) == (sparse.SlidingWindow(8), 8)
    assert strided_parts(sparse.Causal() & sparse.Strided(8)) == (sparse.SlidingWindow(8), 8)
    assert strided_parts(sparse.Strided(1)) is None  # causal: nothing strided to split off
    assert strided_parts(sparse.Strided(8) | sparse.GlobalTokens(2)) is None
    assert strided_parts(sparse.Strided(8) & sparse.SlidingWindow(64)) is None
    assert strided_parts(None) is None


def _both(query, key, value, **kwargs):
    """(values, gradients) of the blocked path and of the reference."""

    def run(implementation):
        def loss(q, k, v):
            out = dot_product_attention(q, k, v, implementation=implementation, **kwargs)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(query, key, value)

    return run("blocked"), run("reference")


@settings(max_examples=12, deadline=None)
@given(q_len=st.integers(1, 40), kv_len=st.integers(1, 40), stride=st.integers(2, 9),
       num_kv_heads=st.integers(1, 2), group=st.integers(1, 2),
       extra=st.sampled_from(["none", "causal", "segments", "key_mask", "softcap"]))
def test_two_pieces_equal_the_reference(q_len, kv_len, stride, num_kv_heads, group, extra):
    keys = jax.random.split(jax.random.key(q_len * 41 + kv_len), 3)
    heads = (num_kv_heads * group, num_kv_heads, num_kv_heads)
    query, key, value = (jax.random.normal(k, (2, n, h, 8)) for k, n, h in
                         zip(keys, (q_len, kv_len, kv_len), heads, strict=True))
    kwargs = {"sparsity": sparse.Strided(stride)}
    if extra == "causal":
        kwargs["is_causal"] = True
    elif extra == "segments":
        kwargs["query_segment_ids"] = jnp.arange(q_len)[None].repeat(2, 0) // 7
        kwargs["key_segment_ids"] = jnp.arange(kv_len)[None].repeat(2, 0) // 5
    elif extra == "key_mask":  # row 1 pads its last keys; a row may then see no key at all
        kwargs["mask"] = (jnp.arange(kv_len) < jnp.array([[kv_len], [kv_len // 2]]))[
            :, None, None]
    elif extra == "softcap":
        kwargs["softcap"] = 2.0
    with _two_pieces():
        blocked, reference = _both(query, key, value, **kwargs)
    chex.assert_trees_all_close(blocked, reference, atol=2e-5, rtol=2e-5)


@contextlib.contextmanager
def _two_pieces():
    """The blocked path takes `strided_pieces` whatever they cost. dot_product_attention's
    traces are dropped on entry and exit: a cached one would skip (or keep) the choice."""
    original = tfx.ops.attention.blocked.choose_pieces
    tfx.ops.attention.blocked.choose_pieces = strided_pieces
    dot_product_attention.clear_cache()
    try:
        yield
    finally:
        tfx.ops.attention.blocked.choose_pieces = original
        dot_product_attention.clear_cache()


def test_long_strided_attention_takes_the_pieces_and_visits_about_its_pairs():
    n, stride = 4096, 128
    spec = sparse.Strided(stride)
    pieces = choose_pieces(spec, n, n)
    assert pieces == strided_pieces(spec, n, n) and [p.stride for p in pieces] == [1, stride]
    kept = spec.dense(n, n).sum()
    assert visited_pairs(spec, n, n) < 2 * kept  # in token order: most of the causal triangle
    one_pass = choose_pieces(sparse.Strided(stride) | sparse.GlobalTokens(1), n, n)
    assert len(one_pass) == 1


def test_short_strided_attention_keeps_one_pass():
    assert len(choose_pieces(sparse.Strided(16), 300, 300)) == 1


def test_pieces_refuse_a_bias():
    x = jnp.ones((1, 1, 1, 8, 4))
    pieces = strided_pieces(sparse.Strided(2), 8, 8)
    with pytest.raises(ValueError, match="no bias"):
        pieced_attention(x, x[:, :, 0], x[:, :, 0], ScoreInputs(bias=jnp.zeros((1, 1, 1, 8, 8))),
                         pieces, None)
    assert isinstance(pieces[0], Piece)


def test_a_strided_call_with_a_bias_runs_one_pass_and_equals_the_reference():
    n = 512
    assert len(choose_pieces(sparse.Strided(32), n, n)) == 2  # without the bias: two pieces
    keys = jax.random.split(jax.random.key(3), 4)
    query, key, value = (jax.random.normal(k, (1, n, 2, 8)) for k in keys[:3])
    bias = jax.random.normal(keys[3], (1, 2, n, n))
    blocked, reference = _both(query, key, value, bias=bias, sparsity=sparse.Strided(32))
    chex.assert_trees_all_close(blocked, reference, atol=2e-5, rtol=2e-5)
