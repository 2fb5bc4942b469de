"""Tests for tfx.ops.sparse: each spec against its paper definition, written out as Python loops."""

import dataclasses
import functools
import tracemalloc
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops import sparse
from tfx.ops.sparse import (
    Causal,
    Fixed,
    GlobalTokens,
    Intersection,
    RandomBlocks,
    SlidingWindow,
    Strided,
    Union,
)


# Reference predicates, one per spec, written from the definitions (i = query position,
# j = key position), not from the vectorised code under test.
def _random_key_blocks(spec, query_block, kv_len):
    num_key_blocks = -(-kv_len // spec.block)
    rng = np.random.default_rng((spec.seed, query_block))
    return set(rng.choice(num_key_blocks, min(spec.num_random, num_key_blocks), replace=False))


def reference_allows(spec, i, j, kv_len):
    if isinstance(spec, Causal):
        return j <= i
    if isinstance(spec, SlidingWindow):  # the `size` most recent keys, the query's own included
        return j in range(i - spec.size + 1, i + 1)
    if isinstance(spec, Strided):
        # Child et al. 2019, §4.3: A1 = {t, ..., i} with t = max(0, i - l),
        # A2 = {j : (i - j) mod l = 0}; causal by construction.
        stride = spec.stride
        head_1 = set(range(max(0, i - stride), i + 1))
        head_2 = {k for k in range(i + 1) if (i - k) % stride == 0}
        return j in head_1 | head_2
    if isinstance(spec, Fixed):
        # Child et al. 2019, §4.3: A1 = {j : floor(j/l) = floor(i/l)}, A2 = {j : j mod l ∈ {t..l}},
        # t = l - c; causal as in their autoregressive models.
        block, summary = spec.block, spec.summary
        head_1 = j // block == i // block
        head_2 = j % block in range(block - summary, block)
        return j <= i and (head_1 or head_2)
    if isinstance(spec, GlobalTokens):  # Longformer: global tokens attend to and from everything
        return i < spec.n or j < spec.n
    if isinstance(spec, RandomBlocks):  # BigBird: random key blocks per query block
        return j // spec.block in _random_key_blocks(spec, i // spec.block, kv_len)
    raise AssertionError(f"no reference for {spec}")


def reference_dense(spec, q_len, kv_len, q_offset=0):
    rows = [
        [reference_allows(spec, q_offset + r, j, kv_len) for j in range(kv_len)]
        for r in range(q_len)
    ]
    return np.array(rows, dtype=bool)


SHAPES = [  # (q_len, kv_len, q_offset)
    (1, 1, 0),
    (7, 7, 0),
    (5, 13, 0),
    (13, 5, 0),
    (5, 13, 8),  # decoding: the queries are the last 5 of 13 positions
    (9, 20, 3),
    (6, 4, 2),
]

SPECS = [
    Causal(),
    SlidingWindow(1),
    SlidingWindow(3),
    SlidingWindow(50),
    Strided(1),
    Strided(3),
    Fixed(4, 1),
    Fixed(3, 3),
    Fixed(5, 2),
    GlobalTokens(1),
    GlobalTokens(3),
    RandomBlocks(3, 2),
    RandomBlocks(4, 1, seed=7),
    RandomBlocks(2, 50),  # more random blocks than key blocks: every key block
]


@pytest.mark.parametrize("q_len,kv_len,q_offset", SHAPES)
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_dense_matches_paper_definition(spec, q_len, kv_len, q_offset):
    mask = spec.dense(q_len, kv_len, q_offset=q_offset)
    assert mask.dtype == np.bool_ and mask.shape == (q_len, kv_len)
    np.testing.assert_array_equal(mask, reference_dense(spec, q_len, kv_len, q_offset))


def test_causal_dense_matches_jax_is_causal_convention():
    # Reference: jax.nn.dot_product_attention(is_causal=True) is top-left aligned; with
    # q_offset = kv_len - q_len it is bottom-right (cached decoding).
    np.testing.assert_array_equal(Causal().dense(3, 5), np.tril(np.ones((3, 5), bool)))
    np.testing.assert_array_equal(
        Causal().dense(3, 5, q_offset=2), np.tril(np.ones((3, 5), bool), k=2)
    )


@pytest.mark.parametrize("q_len,kv_len,q_offset", SHAPES)
def test_union_and_intersection_are_numpy_or_and(q_len, kv_len, q_offset):
    a, b, c = SlidingWindow(2), GlobalTokens(2), RandomBlocks(3, 1, seed=1)
    dense = {s: s.dense(q_len, kv_len, q_offset=q_offset) for s in (a, b, c)}
    cases = {
        a | b: dense[a] | dense[b],
        a & c: dense[a] & dense[c],
        (a | b) & c: (dense[a] | dense[b]) & dense[c],
        a | (b & c): dense[a] | (dense[b] & dense[c]),
        Union(a, b, c): dense[a] | dense[b] | dense[c],
        Intersection(a, b, c): dense[a] & dense[b] & dense[c],
    }
    for spec, expected in cases.items():
        np.testing.assert_array_equal(spec.dense(q_len, kv_len, q_offset=q_offset), expected)


def test_combinators_build_flat_unions_and_intersections():
    a, b, c = Causal(), SlidingWindow(4), GlobalTokens(1)
    assert isinstance(a | b, Union) and isinstance(a & b, Intersection)
    assert (a | b) | c == a | (b | c) == Union(a, b, c)
    assert (a | b | c).parts == (a, b, c)
    assert (a & b & c).parts == (a, b, c)
    assert (a | (b & c)).parts == (a, Intersection(b, c))  # a different kind stays one part


def _naive_block_layout(mask, block_q, block_k):
    q_len, kv_len = mask.shape
    return np.array(
        [
            [mask[r : r + block_q, k : k + block_k].any() for k in range(0, kv_len, block_k)]
            for r in range(0, q_len, block_q)
        ],
        dtype=bool,
    )


_simple_specs = st.one_of(
    st.just(Causal()),
    st.builds(SlidingWindow, st.integers(1, 20)),
    st.builds(Strided, st.integers(1, 8)),
    st.integers(1, 8).flatmap(lambda b: st.builds(Fixed, st.just(b), st.integers(1, b))),
    st.builds(GlobalTokens, st.integers(1, 6)),
    st.builds(RandomBlocks, st.integers(1, 9), st.integers(1, 4), st.integers(0, 3)),
)
_specs = st.one_of(
    _simple_specs,
    st.builds(Union, _simple_specs, _simple_specs),
    st.builds(Intersection, _simple_specs, _simple_specs),
    st.builds(lambda a, b, c: (a | b) & c, _simple_specs, _simple_specs, _simple_specs),
)


@settings(max_examples=30, deadline=None)
@given(
    spec=_specs,
    q_len=st.integers(1, 60),
    kv_len=st.integers(1, 60),
    block_q=st.integers(1, 17),
    block_k=st.integers(1, 17),
    q_offset=st.integers(0, 20),
    chunk_elements=st.sampled_from([1, 50, 1 << 20]),  # 1: one tile per chunk, both axes split
    granule=st.sampled_from([2, 3, 64]),  # 2, 3: tiles of whole granules pool the granules' layout
)
def test_block_layout_is_any_over_each_tile(
    spec, q_len, kv_len, block_q, block_k, q_offset, chunk_elements, granule
):
    # Reference: the dense mask cut into tiles (partial last tiles included) and OR-ed per tile.
    expected = _naive_block_layout(spec.dense(q_len, kv_len, q_offset=q_offset), block_q, block_k)
    with (mock.patch.object(sparse, "_CHUNK_ELEMENTS", chunk_elements),
          mock.patch.object(sparse, "LAYOUT_GRANULE", granule)):
        sparse._block_layout.cache_clear()
        layout = spec.block_layout(q_len, kv_len, block_q, block_k, q_offset=q_offset)
    assert layout.shape == (-(-q_len // block_q), -(-kv_len // block_k))
    np.testing.assert_array_equal(layout, expected)


def test_block_layout_is_cached_and_read_only():
    first = SlidingWindow(8).block_layout(64, 64, 16, 16)
    assert SlidingWindow(8).block_layout(64, 64, 16, 16) is first
    with pytest.raises(ValueError, match="read-only"):
        first[0, 0] = False


def test_sliding_window_block_layout_on_long_sequence_is_a_band_in_bounded_memory():
    # Reference: a query block a of 128 positions with a 256-key window reaches back into key
    # blocks a-2, a-1 and a exactly. The dense mask alone would be 16384² bytes = 256 MiB.
    n = 16384 // 128
    band = np.tri(n, n, 0, dtype=bool) & ~np.tri(n, n, -3, dtype=bool)
    sparse._block_layout.cache_clear()
    tracemalloc.start()
    try:
        layout = SlidingWindow(256).block_layout(16384, 16384, 128, 128)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(layout, band)
    assert peak < 64 * 2**20, f"block_layout peaked at {peak / 2**20:.0f} MiB"
    # Decoding the last 128 queries of the same sequence sees the last band row.
    decode = SlidingWindow(256).block_layout(128, 16384, 128, 128, q_offset=16384 - 128)
    np.testing.assert_array_equal(decode, band[-1:])


def test_random_blocks_is_deterministic_per_seed():
    spec = RandomBlocks(4, 2, seed=3)
    np.testing.assert_array_equal(spec.dense(32, 64), RandomBlocks(4, 2, seed=3).dense(32, 64))
    assert not np.array_equal(spec.dense(32, 64), RandomBlocks(4, 2, seed=4).dense(32, 64))


@pytest.mark.parametrize("num_random,kv_len", [(1, 40), (3, 40), (3, 37), (10, 40), (12, 20)])
def test_random_blocks_picks_min_num_random_key_blocks_per_query_block(num_random, kv_len):
    spec = RandomBlocks(4, num_random, seed=1)
    num_key_blocks = -(-kv_len // 4)
    layout = spec.block_layout(33, kv_len, 4, 4, q_offset=8)
    np.testing.assert_array_equal(layout.sum(axis=1), min(num_random, num_key_blocks))


def test_random_blocks_choice_does_not_depend_on_q_len_or_q_offset():
    spec = RandomBlocks(4, 2, seed=5)
    longest = spec.dense(48, 40)
    for q_len in (1, 5, 16, 30):
        np.testing.assert_array_equal(spec.dense(q_len, 40), longest[:q_len])
        np.testing.assert_array_equal(spec.dense(q_len, 40, q_offset=13), longest[13 : 13 + q_len])


def test_equal_specs_are_equal_hashable_and_frozen():
    assert SlidingWindow(4) == SlidingWindow(4) and hash(SlidingWindow(4)) == hash(SlidingWindow(4))
    assert SlidingWindow(np.int64(4)) == SlidingWindow(4)  # numpy ints are stored as Python ints
    assert type(SlidingWindow(np.int64(4)).size) is int
    assert SlidingWindow(4) != SlidingWindow(5)
    assert SlidingWindow(4) != Strided(4)
    combo = (SlidingWindow(4) | GlobalTokens(2)) & Causal()
    assert combo == (SlidingWindow(4) | GlobalTokens(2)) & Causal()
    assert hash(combo) == hash((SlidingWindow(4) | GlobalTokens(2)) & Causal())
    assert Union(Causal(), GlobalTokens(1)) != Intersection(Causal(), GlobalTokens(1))
    assert len({RandomBlocks(4, 2), RandomBlocks(4, 2, seed=0), RandomBlocks(4, 2, seed=1)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        SlidingWindow(4).size = 5


def test_spec_is_a_jit_static_argument_that_does_not_retrace_for_an_equal_spec():
    traces = []

    @functools.partial(jax.jit, static_argnames="spec")
    def masked(x, spec):
        traces.append(spec)
        return jnp.where(spec.dense(*x.shape), x, 0.0)

    x = jnp.ones((4, 6))
    first = masked(x, spec=SlidingWindow(2) | GlobalTokens(1))
    masked(x, spec=SlidingWindow(2) | GlobalTokens(1))  # equal but distinct object
    assert len(traces) == 1
    np.testing.assert_array_equal(first, (SlidingWindow(2) | GlobalTokens(1)).dense(4, 6))
    masked(x, spec=SlidingWindow(3))
    assert len(traces) == 2


@pytest.mark.parametrize(
    "build,error,match",
    [
        (lambda: SlidingWindow(0), ValueError, "SlidingWindow size must be >= 1, got 0"),
        (lambda: SlidingWindow(2.0), TypeError, "SlidingWindow size must be an int, got float"),
        (lambda: SlidingWindow(True), TypeError, "SlidingWindow size must be an int, got bool"),
        (lambda: Strided(0), ValueError, "Strided stride must be >= 1, got 0"),
        (lambda: Fixed(0, 1), ValueError, "Fixed block must be >= 1, got 0"),
        (lambda: Fixed(4, 0), ValueError, "Fixed summary must be >= 1, got 0"),
        (lambda: Fixed(4, 5), ValueError, r"Fixed summary \(5\) must be <= block \(4\)"),
        (lambda: GlobalTokens(0), ValueError, "GlobalTokens n must be >= 1, got 0"),
        (lambda: GlobalTokens("2"), TypeError, "GlobalTokens n must be an int, got str"),
        (lambda: RandomBlocks(0, 1), ValueError, "RandomBlocks block must be >= 1, got 0"),
        (lambda: RandomBlocks(4, 0), ValueError, "RandomBlocks num_random must be >= 1, got 0"),
        (lambda: RandomBlocks(4, 1, seed=-1), ValueError, "RandomBlocks seed must be >= 0, got -1"),
        (lambda: Union(), ValueError, "Union needs at least one part"),
        (lambda: Intersection(), ValueError, "Intersection needs at least one part"),
        (lambda: Union(Causal(), "x"), TypeError, "Union parts must be SparsitySpecs, got str"),
        (lambda: Causal() | 3, TypeError, "unsupported operand"),
        (lambda: Causal() & None, TypeError, "unsupported operand"),
        (lambda: Causal().dense(0, 4), ValueError, "q_len must be >= 1, got 0"),
        (lambda: Causal().dense(4, 0), ValueError, "kv_len must be >= 1, got 0"),
        (lambda: Causal().dense(4.0, 4), TypeError, "q_len must be an int, got float"),
        (lambda: Causal().dense(4, 4, q_offset=-1), ValueError, "q_offset must be >= 0, got -1"),
        (lambda: Causal().block_layout(0, 4, 2, 2), ValueError, "q_len must be >= 1, got 0"),
        (lambda: Causal().block_layout(4, 0, 2, 2), ValueError, "kv_len must be >= 1, got 0"),
        (lambda: Causal().block_layout(4, 4, 0, 2), ValueError, "block_q must be >= 1, got 0"),
        (lambda: Causal().block_layout(4, 4, 2, 0), ValueError, "block_k must be >= 1, got 0"),
        (lambda: Causal().block_layout(4, 4, 2, 2.5), TypeError, "block_k must be an int"),
        (
            lambda: Causal().block_layout(4, 4, 2, 2, q_offset=-3),
            ValueError,
            "q_offset must be >= 0, got -3",
        ),
    ],
)
def test_bad_input_raises(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_after_prefix_shows_every_prefix_key_and_shifts_the_inner_mask():
    # prefix tuning with 2 learned keys before 3 real ones: causal over the real keys only
    expected = np.array([[1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(sparse.LeadingKeys(sparse.Causal(), 2).dense(3, 5), expected)
    window = sparse.LeadingKeys(sparse.SlidingWindow(2), 1).dense(4, 5)
    np.testing.assert_array_equal(window[:, 1:], sparse.SlidingWindow(2).dense(4, 4))
    assert window[:, 0].all()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("causal", Causal()),
        ("window:256", SlidingWindow(256)),
        ("strided:45", Strided(45)),
        ("fixed:128,8", Fixed(128, 8)),
        ("global:16", GlobalTokens(16)),
        ("random:64,2", RandomBlocks(64, 2)),
        ("random:64,2,7", RandomBlocks(64, 2, seed=7)),
        (" window: 4 | global:2 ", Union(SlidingWindow(4), GlobalTokens(2))),
        (
            "window:256|global:16|random:64,2",
            SlidingWindow(256) | GlobalTokens(16) | RandomBlocks(64, 2),
        ),
    ],
)
def test_parse_spec_builds_the_named_specs(text, expected):
    spec = sparse.parse_spec(text)
    assert spec == expected
    parts = expected.parts if isinstance(expected, Union) else (expected,)
    reference = np.logical_or.reduce([reference_dense(part, 9, 9) for part in parts])
    np.testing.assert_array_equal(spec.dense(9, 9), reference)


def test_parse_spec_names_every_spec_of_the_grammar():
    assert set(sparse.SPEC_NAMES) == {"causal", "window", "strided", "fixed", "global", "random"}
    for name in sparse.SPEC_NAMES:
        assert name in sparse.SPEC_GRAMMAR
    assert "random:block,num_random[,seed]" in sparse.SPEC_GRAMMAR


@pytest.mark.parametrize(
    "text, match",
    [
        ("", r"bad part '' .*unknown name ''"),
        ("tile:4", r"bad part 'tile:4' .*unknown name 'tile'"),
        ("window", r"bad part 'window' .*got 0 argument\(s\), expected window:size"),
        ("window:4,5", r"got 2 argument\(s\), expected window:size"),
        ("causal:1", r"got 1 argument\(s\), expected causal"),
        ("random:64", r"expected random:block,num_random\[,seed\]"),
        ("window:2.5", r"bad part 'window:2.5' .*invalid literal"),
        ("window:0", r"bad part 'window:0' .*SlidingWindow size must be >= 1"),
        ("fixed:4,8", r"Fixed summary \(8\) must be <= block \(4\)"),
        ("window:4|", r"bad part '' of sparsity spec 'window:4\|'"),
    ],
)
def test_parse_spec_errors_name_the_part_and_give_the_grammar(text, match):
    with pytest.raises(ValueError, match=match) as raised:
        sparse.parse_spec(text)
    assert sparse.SPEC_GRAMMAR in str(raised.value)


def test_parse_spec_wants_a_str():
    with pytest.raises(TypeError, match="must be a str, got int"):
        sparse.parse_spec(4)
