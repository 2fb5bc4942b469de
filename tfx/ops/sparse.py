"""Sparse attention masks as small, frozen, hashable specifications.

A spec says which (query, key) pairs may attend (True = may attend). Positions are top-left
aligned: query row r sits at position `q_offset + r` and key column j at position j, as with
`is_causal` in `jax.nn.dot_product_attention`; cached decoding, where the queries are the last
`q_len` of `kv_len` positions, passes `q_offset = kv_len - q_len`.

Each spec is written once, as a numpy predicate on broadcast position arrays (`allows`), from
which both the dense mask and the block layout (which tiles a blocked kernel may not skip) are
computed at trace time. Specs are frozen dataclasses, so equal specs hash equal and can be
static arguments of `jax.jit`. Combine them with `|` (union) and `&` (intersection):

    SlidingWindow(4096) | GlobalTokens(2)          # Longformer-style local + global
    Causal() & (SlidingWindow(64) | RandomBlocks(64, 3))

`parse_spec` reads a union from a short text, as configs hold it:
`parse_spec("window:64|random:64,3") == SlidingWindow(64) | RandomBlocks(64, 3)`.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import ClassVar

import numpy as np

from tfx.ops import _checks

__all__ = [
    "SPEC_GRAMMAR",
    "SPEC_NAMES",
    "Causal",
    "Fixed",
    "GlobalTokens",
    "Intersection",
    "LeadingKeys",
    "Offset",
    "RandomBlocks",
    "SlidingWindow",
    "SparsitySpec",
    "Strided",
    "Union",
    "parse_spec",
]

# block_layout evaluates the predicate on about this many (query, key) pairs at a time, so a
# long sequence never holds its whole [q_len, kv_len] mask (nor the int64 temporaries of a
# predicate, 8 bytes per pair) in memory at once.
_CHUNK_ELEMENTS = 1 << 20
# Layouts of tiles made of whole 64 x 64 granules are pooled from the granules' layout, so the
# predicate runs over every pair once however many tile sizes are asked for (the kernels' tile
# choice compares several; at N = 16384 one pass takes seconds).
LAYOUT_GRANULE = 64


class SparsitySpec(abc.ABC):
    """Base of all mask specs: the shared dense / block-layout logic and the `|`, `&` operators."""

    @abc.abstractmethod
    def allows(self, q_pos: np.ndarray, k_pos: np.ndarray, kv_len: int) -> np.ndarray:
        """The predicate: may the query at `q_pos` attend to the key at `k_pos`?

        Args:
          q_pos: numpy int array of absolute query positions (e.g. [Tq, 1]).
          k_pos: numpy int array of key positions in [0, kv_len), broadcastable with `q_pos`
            (e.g. [1, S]).
          kv_len: number of keys (some specs, such as RandomBlocks, depend on it).
        Returns:
          numpy bool array of the broadcast shape of `q_pos` and `k_pos`.
        """

    def dense(self, q_len: int, kv_len: int, *, q_offset: int = 0) -> np.ndarray:
        """The full mask, computed with numpy (at trace time under `jax.jit`).

        Returns:
          numpy bool array [q_len, kv_len], True where query `q_offset + r` may attend key j.
        """
        q_len, kv_len, q_offset = _check_lengths(q_len, kv_len, q_offset)
        return self.allows(q_offset + np.arange(q_len)[:, None], np.arange(kv_len)[None, :], kv_len)

    def block_layout(
        self, q_len: int, kv_len: int, block_q: int, block_k: int, *, q_offset: int = 0
    ) -> np.ndarray:
        """Which (query block, key block) tiles hold at least one True of `dense`.

        Exact for any spec, combinations included: the predicate is evaluated on the real
        positions a chunk of tiles at a time (bounded memory), and positions past `q_len` or
        `kv_len` in a partial last block count as absent. Results are cached, so the blocked
        kernel may ask at every trace.

        Returns:
          read-only numpy bool array [ceil(q_len / block_q), ceil(kv_len / block_k)].
        """
        q_len, kv_len, q_offset = _check_lengths(q_len, kv_len, q_offset)
        block_q = _checks.positive_int("block_q", block_q)
        block_k = _checks.positive_int("block_k", block_k)
        return _block_layout(self, q_len, kv_len, block_q, block_k, q_offset)

    def __or__(self, other: SparsitySpec) -> Union:
        if not isinstance(other, SparsitySpec):
            return NotImplemented
        return Union(self, other)

    def __and__(self, other: SparsitySpec) -> Intersection:
        if not isinstance(other, SparsitySpec):
            return NotImplemented
        return Intersection(self, other)


def _check_lengths(q_len, kv_len, q_offset) -> tuple[int, int, int]:
    return (
        _checks.positive_int("q_len", q_len),
        _checks.positive_int("kv_len", kv_len),
        _checks.positive_int("q_offset", q_offset, minimum=0),
    )


@functools.lru_cache(maxsize=64)
def _block_layout(
    spec: SparsitySpec, q_len: int, kv_len: int, block_q: int, block_k: int, q_offset: int
) -> np.ndarray:
    if (block_q, block_k) != (LAYOUT_GRANULE,) * 2 and not (block_q % LAYOUT_GRANULE
                                                          or block_k % LAYOUT_GRANULE):
        # Any tile made of whole granules holds a visible pair iff one of its granules does.
        fine = _block_layout(spec, q_len, kv_len, LAYOUT_GRANULE, LAYOUT_GRANULE, q_offset)
        return _pooled(fine, block_q // LAYOUT_GRANULE, block_k // LAYOUT_GRANULE)
    nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
    tiles_per_chunk = max(1, _CHUNK_ELEMENTS // (block_q * block_k))
    # A chunk spans up to tiles_per_chunk key blocks, then as many query blocks as still fit.
    k_step = min(nk, tiles_per_chunk)
    q_step = max(1, tiles_per_chunk // k_step)
    layout = np.empty((nq, nk), dtype=bool)
    for qb in range(0, nq, q_step):
        rows = np.arange(qb * block_q, min((qb + q_step) * block_q, q_len))
        for kb in range(0, nk, k_step):
            cols = np.arange(kb * block_k, min((kb + k_step) * block_k, kv_len))
            allowed = spec.allows(q_offset + rows[:, None], cols[None, :], kv_len)
            # reduceat on block starts ORs each (possibly partial, last) tile without padding.
            per_key_block = np.logical_or.reduceat(allowed, np.arange(0, cols.size, block_k), 1)
            tiles = np.logical_or.reduceat(per_key_block, np.arange(0, rows.size, block_q), 0)
            layout[qb : qb + q_step, kb : kb + k_step] = tiles
    layout.flags.writeable = False  # shared by every caller through the cache
    return layout


def _pooled(layout: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """OR over groups of `rows` x `cols` tiles (the last group of each axis may be partial)."""
    pooled = np.logical_or.reduceat(layout, np.arange(0, layout.shape[0], rows), 0)
    pooled = np.logical_or.reduceat(pooled, np.arange(0, layout.shape[1], cols), 1)
    pooled.flags.writeable = False
    return pooled


@dataclasses.dataclass(frozen=True)
class LeadingKeys(SparsitySpec):
    """`inner` over the keys that follow `num_leading` leading keys (learned keys put before
    the real ones, e.g. `tfx.ops.leading_keys.prepend_keys`), which every query sees: a causal
    mask after G such keys is LeadingKeys(Causal(), G), not a top-left aligned causal mask over
    all keys. Static, so blocked kernels still skip the tiles that `inner` leaves empty."""

    inner: SparsitySpec
    num_leading: int

    def allows(self, q_pos, k_pos, kv_len):
        shifted = np.maximum(k_pos - self.num_leading, 0)  # leading columns are answered below
        inner = self.inner.allows(q_pos, shifted, kv_len - self.num_leading)
        return (k_pos < self.num_leading) | inner


@dataclasses.dataclass(frozen=True)
class Offset(SparsitySpec):
    """`inner` seen from a tile of a longer sequence: query row r sits at position
    `query_start + r` and key column j at `key_start + j` of the sequence `inner` is written
    for, whose length is `total_len`. Context-parallel attention
    (`tfx.ops.attention.context_parallel`) plans each pair of sequence chunks with it, so that the
    blocked kernel skips the tiles of a chunk pair that `inner` leaves empty."""

    inner: SparsitySpec
    query_start: int
    key_start: int
    total_len: int

    def allows(self, q_pos, k_pos, kv_len):
        return self.inner.allows(q_pos + self.query_start, k_pos + self.key_start,
                                 self.total_len)


@dataclasses.dataclass(frozen=True)
class Causal(SparsitySpec):
    """Causal mask: key j is visible from query i iff j <= i."""

    def allows(self, q_pos, k_pos, kv_len):
        return k_pos <= q_pos


@dataclasses.dataclass(frozen=True)
class SlidingWindow(SparsitySpec):
    """Mistral-style causal window of `size` keys, the query's own included: i - size < j <= i."""

    size: int

    def __post_init__(self):
        object.__setattr__(self, "size", _checks.positive_int("SlidingWindow size", self.size))

    def allows(self, q_pos, k_pos, kv_len):
        distance = q_pos - k_pos
        return (distance >= 0) & (distance < self.size)


@dataclasses.dataclass(frozen=True)
class Strided(SparsitySpec):
    """Strided pattern of Child et al. 2019 (Sparse Transformers), both heads merged.

    Causal, and either within the last `stride` positions or a multiple of `stride` back:
    j <= i and ((i - j) < stride or (i - j) % stride == 0).
    """

    stride: int

    def __post_init__(self):
        object.__setattr__(self, "stride", _checks.positive_int("Strided stride", self.stride))

    def allows(self, q_pos, k_pos, kv_len):
        distance = q_pos - k_pos
        return (distance >= 0) & ((distance < self.stride) | (distance % self.stride == 0))


@dataclasses.dataclass(frozen=True)
class Fixed(SparsitySpec):
    """Fixed pattern of Child et al. 2019 (Sparse Transformers), both heads merged.

    Causal (j <= i), and either in the query's own block (j // block == i // block) or one of the
    last `summary` positions of a block (j % block >= block - summary). 1 <= summary <= block.
    """

    block: int
    summary: int

    def __post_init__(self):
        object.__setattr__(self, "block", _checks.positive_int("Fixed block", self.block))
        object.__setattr__(self, "summary", _checks.positive_int("Fixed summary", self.summary))
        if self.summary > self.block:
            raise ValueError(f"Fixed summary ({self.summary}) must be <= block ({self.block})")

    def allows(self, q_pos, k_pos, kv_len):
        same_block = k_pos // self.block == q_pos // self.block
        summary = k_pos % self.block >= self.block - self.summary
        return (k_pos <= q_pos) & (same_block | summary)


@dataclasses.dataclass(frozen=True)
class GlobalTokens(SparsitySpec):
    """Longformer-style global tokens: the first `n` positions see and are seen by all positions.

    i < n or j < n.
    """

    n: int

    def __post_init__(self):
        object.__setattr__(self, "n", _checks.positive_int("GlobalTokens n", self.n))

    def allows(self, q_pos, k_pos, kv_len):
        return (q_pos < self.n) | (k_pos < self.n)


@dataclasses.dataclass(frozen=True)
class RandomBlocks(SparsitySpec):
    """BigBird random attention (bidirectional).

    Each query block (queries with the same i // block) attends to min(num_random, nk) of the
    nk = ceil(kv_len / block) key blocks, drawn without replacement by a numpy Generator seeded
    with (seed, query block index): the draw for a block does not depend on q_len or q_offset.
    """

    block: int
    num_random: int
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "block", _checks.positive_int("RandomBlocks block", self.block))
        num_random = _checks.positive_int("RandomBlocks num_random", self.num_random)
        object.__setattr__(self, "num_random", num_random)
        seed = _checks.positive_int("RandomBlocks seed", self.seed, minimum=0)
        object.__setattr__(self, "seed", seed)

    def allows(self, q_pos, k_pos, kv_len):
        num_key_blocks = -(-kv_len // self.block)
        query_blocks, row_of = np.unique(q_pos // self.block, return_inverse=True)
        chosen = np.zeros((query_blocks.size, num_key_blocks), dtype=bool)
        for row, query_block in enumerate(query_blocks):
            rng = np.random.default_rng((self.seed, int(query_block)))
            picks = rng.choice(num_key_blocks, min(self.num_random, num_key_blocks), replace=False)
            chosen[row, picks] = True
        return chosen[row_of.reshape(np.shape(q_pos)), k_pos // self.block]


@dataclasses.dataclass(frozen=True, init=False)
class _Combination(SparsitySpec):
    """Shared body of Union and Intersection: a flat tuple of parts, combined elementwise."""

    parts: tuple[SparsitySpec, ...]
    _combine: ClassVar[np.ufunc]

    def __init__(self, *parts: SparsitySpec):
        # Nested combinations of the same kind flatten, so (a | b) | c == a | (b | c).
        flat = tuple(q for p in parts for q in (p.parts if type(p) is type(self) else (p,)))
        object.__setattr__(self, "parts", flat)
        self.__post_init__()

    def __post_init__(self):
        name = type(self).__name__
        if not self.parts:
            raise ValueError(f"{name} needs at least one part")
        for part in self.parts:
            if not isinstance(part, SparsitySpec):
                raise TypeError(f"{name} parts must be SparsitySpecs, got {type(part).__name__}")

    def allows(self, q_pos, k_pos, kv_len):
        return functools.reduce(self._combine, (p.allows(q_pos, k_pos, kv_len) for p in self.parts))


@dataclasses.dataclass(frozen=True, init=False)
class Union(_Combination):
    """Elementwise OR of its parts (`a | b`): may attend where any part allows."""

    _combine = np.logical_or


@dataclasses.dataclass(frozen=True, init=False)
class Intersection(_Combination):
    """Elementwise AND of its parts (`a & b`): may attend where every part allows."""

    _combine = np.logical_and


# The names of parse_spec's text form; a spec's arguments are its dataclass fields, in order.
SPEC_NAMES: dict[str, type[SparsitySpec]] = {
    "causal": Causal,
    "window": SlidingWindow,
    "strided": Strided,
    "fixed": Fixed,
    "global": GlobalTokens,
    "random": RandomBlocks,
}


def _usage(name: str) -> str:
    """`name:arg,arg` as the grammar writes it, optional arguments in brackets."""
    args = "".join(f",{f.name}" if f.default is dataclasses.MISSING else f"[,{f.name}]"
                   for f in dataclasses.fields(SPEC_NAMES[name]))
    return f"{name}:{args[1:]}" if args else name


SPEC_GRAMMAR = ("parts joined by '|' (their union), each one of "
                + ", ".join(map(_usage, SPEC_NAMES)) + " (int arguments)")


def parse_spec(text: str) -> SparsitySpec:
    """A spec from its text form: parts joined by "|" (their union), each `name:arg,arg`.

    Names and arguments (ints, in the order of the spec's fields; see SPEC_GRAMMAR): causal,
    window:size, strided:stride, fixed:block,summary, global:n, random:block,num_random[,seed].
    For example "window:256|global:16|random:64,2" is BigBird's pattern,
    SlidingWindow(256) | GlobalTokens(16) | RandomBlocks(64, 2).

    Raises:
      TypeError: `text` is not a str.
      ValueError: naming the bad part and giving the grammar.
    """
    if not isinstance(text, str):
        raise TypeError(f"a sparsity spec text must be a str, got {type(text).__name__}")
    parts = [_parse_part(part, text) for part in text.split("|")]
    return parts[0] if len(parts) == 1 else Union(*parts)


def _parse_part(part: str, text: str) -> SparsitySpec:
    name, _, args = part.partition(":")
    try:
        cls = SPEC_NAMES.get(name.strip())
        if cls is None:
            raise ValueError(f"unknown name {name.strip()!r}")
        values = [int(arg) for arg in args.split(",")] if args.strip() else []
        fields = dataclasses.fields(cls)
        required = sum(f.default is dataclasses.MISSING for f in fields)
        if not required <= len(values) <= len(fields):
            raise ValueError(f"got {len(values)} argument(s), expected {_usage(name.strip())}")
        return cls(*values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad part {part!r} of sparsity spec {text!r}: {e}; "
                         f"grammar: {SPEC_GRAMMAR}") from None
