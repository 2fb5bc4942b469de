"""Context parallelism: self-attention over a sequence split across the devices of a mesh axis.

Each of the n devices of the "sequence" axis holds a slice of the queries, keys and values
(the activations of a model whose sequence dim is split over that axis), and no device ever
holds the whole sequence. Two exchanges, chosen by size in `tfx.ops.backends`:

"ring" (Liu et al. 2023, Ring Attention): every device keeps its queries while the keys and
values travel around the ring with `ppermute`, one hop a step for n steps. At each step the
device attends its queries to the keys it holds with the blocked kernel and merges the partial
output with the running one through their log-sum-exp: the online softmax of
`tfx.ops.attention.blocked_attention`, carried across devices. The backward pass (a custom VJP)
sends
the keys and values around once more with their gradients dK, dV travelling beside them, so
that each device's dK, dV arrive home after the n-th hop. Memory per device is O(T / n); a
step's transfer does not depend on its compute, so XLA may overlap the two.

"all_gather": every device gathers all keys and values once and attends its queries to them
a chunk at a time; the backward sums dK, dV with `psum_scatter`. Fewer, larger transfers,
for short rings and small K/V (GQA, MQA); memory O(T) for K/V only.

Causal load balance: under a causal or windowed mask the device holding the first slice would
see few keys and the last one many. The sequence is therefore cut into 2n chunks and device d
holds chunks d and 2n - 1 - d (the zigzag of Megatron-LM's context parallelism), which gives
every device the same work. The inputs arrive split contiguously over the axis; two
`ppermute`s reorder the chunks and two more return the output. Masks without a static spec
(bidirectional attention, segments only) keep the contiguous split.

Tiles: every (query chunk, key chunk) pair gets a static block plan from the mask's spec at the
pair's offsets (`tfx.ops.sparse.Offset`), identical plans are compiled once, and a pair with no
visible key (causal: a key chunk after the query chunk; a window: chunks out of its reach)
skips its compute through a `lax.switch`. GQA/MQA keys travel with their num_kv_heads heads,
never repeated. Segment ids (packed sequences) and a key padding mask travel with the keys; a
query row that sees no key returns zeros.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from tfx.ops import _checks
from tfx.ops.attention.blocked_attention import (
    BLOCK_K,
    BLOCK_Q,
    NO_KEYS_LOG_SUM_EXP,
    ScoreInputs,
    blocked_attention_backward,
    blocked_attention_forward,
)
from tfx.ops.attention.context_layout import ChunkLayout, pair_plans
from tfx.ops.attention.kernel import Call, Kernel, at_least, key_mask_only, without
from tfx.ops.attention.splash import call_segment_ids
from tfx.ops.backends import select_context_exchange
from tfx.ops.sparse import SparsitySpec

__all__ = [
    "CONTEXT_EXCHANGES",
    "KERNEL",
    "SEQUENCE_AXIS",
    "context_parallel_attention",
    "pair_plans",
    "split_sequence",
]

SEQUENCE_AXIS = "sequence"  # as tfx.parallel.mesh names it (ops sit below tfx.parallel)
BATCH_AXES = ("data", "fsdp", "expert")  # as tfx.parallel.sharding.BATCH_AXES
HEAD_AXIS = "tensor"
CONTEXT_EXCHANGES = ("ring", "all_gather")


@functools.partial(jax.jit, static_argnames=("mesh", "spec", "scale", "axis", "exchange",
                                             "block_sizes", "softcap"))
def context_parallel_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                               mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
                               spec: SparsitySpec | None = None, scale: float | None = None,
                               query_segment_ids: jax.Array | None = None,
                               key_segment_ids: jax.Array | None = None,
                               axis: str = SEQUENCE_AXIS, exchange: str | None = None,
                               block_sizes: tuple[int, int] | None = None,
                               softcap: float | None = None) -> jax.Array:
    """Self-attention with the sequence split over the mesh axis `axis`.

    Args:
      query: [batch, seq, num_heads, head_dim], split (or to be split) over `axis` along seq.
      key: [batch, seq, num_kv_heads, head_dim]; num_kv_heads divides num_heads.
      value: [batch, seq, num_kv_heads, value_dim].
      mesh: a Mesh or AbstractMesh with `axis` (inside `jax.set_mesh`,
        `jax.sharding.get_abstract_mesh()`). The batch is split over the mesh's data axes
        ("data", "fsdp", "expert") that divide it, heads over "tensor" when it divides
        num_kv_heads; other axes compute redundantly.
      spec: the static mask as one `tfx.ops.sparse` spec over the whole sequence (top-left
        aligned; `tfx.ops.attention.static_spec(is_causal, sparsity)`), or None.
      scale: score multiplier, default 1/sqrt(head_dim).
      query_segment_ids: optional int [batch, seq]: a query sees only keys of its segment.
      key_segment_ids: int [batch, seq], default query_segment_ids (a key padding mask is
        passed as key ids no query has, `tfx.ops.attention.splash.key_mask_as_segments`).
      axis: the mesh axis the sequence is split over.
      exchange: "ring", "all_gather" or None (`tfx.ops.backends.select_context_exchange`).
      block_sizes: (block_q, block_k) tiles of the blocked kernel within a chunk.
      softcap: None, or a float > 0 that caps the scaled scores s at softcap·tanh(s / softcap)
        (as in `tfx.ops.dot_product_attention`).
    Returns:
      [batch, seq, num_heads, value_dim] in value's dtype, split like query: equal to
      `tfx.ops.dot_product_attention` with the same arguments, values and gradients.
    Raises:
      ValueError: a mesh without `axis`, seq not divisible into 2n (with a spec) or n chunks,
        query and key lengths that differ, a spec whose chunk pairs need more than
        MAX_PAIR_PLANS tile plans, or a softcap that is not a finite float > 0.
    """
    devices = dict(mesh.shape).get(axis, 0)
    if devices < 1:
        raise ValueError(f"mesh has no axis {axis!r} (axes {tuple(dict(mesh.shape))})")
    batch, seq, num_heads, head_dim = query.shape
    if key.shape[1] != seq:
        raise ValueError(f"context parallelism is for self-attention: key length {key.shape[1]}"
                         f" must equal query length {seq}")
    layout = ChunkLayout.of(devices, seq, zigzag=spec is not None)
    if key_segment_ids is None:
        key_segment_ids = query_segment_ids
    if exchange is None:
        kv_bytes = key.size * key.dtype.itemsize + value.size * value.dtype.itemsize
        exchange = select_context_exchange(devices, kv_bytes // max(batch, 1))
    if exchange not in CONTEXT_EXCHANGES:
        raise ValueError(f"exchange must be one of {CONTEXT_EXCHANGES} or None, got {exchange!r}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if softcap is not None:
        _checks.finite_positive_float("softcap", softcap)
    block_q, block_k = (min(b, layout.chunk_len) for b in block_sizes or (BLOCK_Q, BLOCK_K))
    plans, table = pair_plans(spec, layout.num_chunks, layout.chunk_len, block_q, block_k)
    ring = _Ring(layout, axis, exchange, plans, table, block_q, block_k, softcap)

    tokens = _tokens_spec(mesh, axis, batch)
    heads = _heads_spec(mesh, num_heads, key.shape[2])
    qkv = PartitionSpec(*tokens, heads)
    segments = None if query_segment_ids is None else (query_segment_ids, key_segment_ids)
    return jax.shard_map(
        functools.partial(_local, ring=ring, scale=scale), mesh=mesh,
        in_specs=(qkv, qkv, qkv, PartitionSpec(*tokens)), out_specs=qkv,
        check_vma=False)(query, key, value, segments)


def split_sequence(x: jax.Array) -> jax.Array:
    """`x` [batch, seq, ...] laid out with seq split over the "sequence" axis of the mesh the
    call is traced under (a sharding constraint), so that every layer's activations stay split
    and context-parallel attention finds its slices in place. Unchanged without such an axis,
    or when seq does not divide over it (a decoding step)."""
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else dict(mesh.shape).get(SEQUENCE_AXIS, 1)
    if devices < 2 or x.shape[1] % devices:
        return x
    spec = PartitionSpec(*_tokens_spec(mesh, SEQUENCE_AXIS, x.shape[0]))
    return jax.lax.with_sharding_constraint(x, spec)


def _local(query, key, value, segments, *, ring: _Ring, scale: float):
    """One device's share: its query, key and value slices -> its output slice."""
    layout = ring.layout
    if layout.zigzag:
        query, key, value, segments = ring.reorder((query, key, value, segments), to_zigzag=True)
    q, k, v = layout.chunked(query * jnp.asarray(scale, query.dtype), key, value, ring)
    q_seg = k_seg = None
    if segments is not None:
        q_seg, k_seg = (layout.chunked_ids(ids, size) for ids, size in
                        zip(segments, (ring.padded_q, ring.padded_k), strict=True))
    out = ring.attend(q, k, v, q_seg, k_seg)
    out = layout.unchunked(out, query.shape[2]).astype(value.dtype)
    return ring.reorder(out, to_zigzag=False) if layout.zigzag else out


def _tokens_spec(mesh, axis: str, batch: int) -> tuple:
    """The PartitionSpec entries of [batch, seq]: batch over the data axes that split it."""
    shape = dict(mesh.shape)
    rows = tuple(a for a in BATCH_AXES if shape.get(a, 1) > 1)
    if rows and batch % math.prod(shape[a] for a in rows):
        rows = ()
    return (rows[0] if len(rows) == 1 else (rows or None)), axis


def _heads_spec(mesh, num_heads: int, num_kv_heads: int) -> str | None:
    size = dict(mesh.shape).get(HEAD_AXIS, 1)
    return HEAD_AXIS if size > 1 and num_kv_heads % size == 0 and num_heads % size == 0 else None


class _Ring:
    """The static plan of one context-parallel attention and its forward and backward loops
    over the n devices of the axis (inside `shard_map`)."""

    def __init__(self, layout: ChunkLayout, axis: str, exchange: str, plans, table, block_q: int,
                 block_k: int, softcap: float | None):
        self.layout, self.axis, self.exchange = layout, axis, exchange
        self.plans, self.table = plans, table
        # The blocked kernel's static keywords, the same for every chunk pair.
        self.tiles = dict(block_q=block_q, block_k=block_k, softcap=softcap)
        self.padded_q = -(-layout.chunk_len // block_q) * block_q
        self.padded_k = -(-layout.chunk_len // block_k) * block_k
        self.attend = jax.custom_vjp(self._attend)
        self.attend.defvjp(self._forward, self._backward)

    # Moving chunks -----------------------------------------------------------------------------

    def reorder(self, tree, *, to_zigzag: bool):
        """Local slices [B, 2C, ...] between the contiguous split (chunks 2d, 2d + 1 on device
        d) and the zigzag one (chunks d, 2n - 1 - d): two ppermutes, one for the even chunks
        and one for the odd ones, each a permutation of the devices."""
        n = self.layout.devices
        even_device = jax.lax.axis_index(self.axis) % 2 == 0

        def home(chunk):  # the device holding `chunk` in the zigzag split
            return chunk if chunk < n else 2 * n - 1 - chunk

        def zigzag_chunks(d):  # (even, odd) chunk of zigzag device d
            return (d, 2 * n - 1 - d) if d % 2 == 0 else (2 * n - 1 - d, d)

        if to_zigzag:
            routes = [[(d, home(2 * d)) for d in range(n)],
                      [(d, home(2 * d + 1)) for d in range(n)]]
        else:
            routes = [[(d, zigzag_chunks(d)[parity] // 2) for d in range(n)]
                      for parity in (0, 1)]

        def move(x):
            first, second = jnp.split(x, 2, axis=1)
            if not to_zigzag:  # (even, odd) from (chunk d, chunk 2n - 1 - d)
                first, second = (jnp.where(even_device, first, second),
                                 jnp.where(even_device, second, first))
            even, odd = (jax.lax.ppermute(part, self.axis, route)
                         for part, route in zip((first, second), routes, strict=True))
            if to_zigzag:  # chunk d is even on even devices
                even, odd = (jnp.where(even_device, even, odd),
                             jnp.where(even_device, odd, even))
            return jnp.concatenate([even, odd], axis=1)

        return jax.tree.map(move, tree)

    def _start(self, keys):
        """The exchange's state before step 0: the local keys (ring) or everyone's (gather)."""
        if self.exchange == "ring":
            return keys
        return jax.lax.all_gather(keys, self.axis)

    def _keys_at(self, state, source):
        """The (key, value, key ids) chunks of device `source`, held at this step."""
        if self.exchange == "ring":
            return state
        return jax.tree.map(lambda x: x[source], state)

    def _pass_on(self, tree):
        """Send `tree` one hop along the ring (the ring exchange; the gather keeps it)."""
        if self.exchange != "ring":
            return tree
        n = self.layout.devices
        return jax.lax.ppermute(tree, self.axis, [(d, (d + 1) % n) for d in range(n)])

    # Pairs of chunks ---------------------------------------------------------------------------

    def _pairs(self, me, source):
        """(a, b, branch) for each query chunk a of this device and key chunk b of `source`:
        branch 0 skips the pair, i > 0 runs it with plan i - 1."""
        table = jnp.asarray(self.table)
        for a, query_chunk in enumerate(self.layout.chunk_ids(me)):
            for b, key_chunk in enumerate(self.layout.chunk_ids(source)):
                yield a, b, table[query_chunk, key_chunk]

    def _merge_pairs(self, q, q_seg, keys, me, source, out, lse):
        """Attend this device's query chunks to the key chunks of `source`, merging each
        chunk pair's partial output into (out, lse) by log-sum-exp."""
        k, v, k_seg = keys

        def merged(plan, operands):
            q_a, k_b, v_b, qs_a, ks_b, out_a, lse_a = operands
            part, part_lse = blocked_attention_forward(q_a, k_b, v_b, ScoreInputs(
                query_segments=qs_a, key_segments=ks_b), plan=plan, **self.tiles)
            total = jnp.logaddexp(lse_a, part_lse)
            out_a = (out_a * jnp.exp(lse_a - total)[..., None]
                     + part * jnp.exp(part_lse - total)[..., None])
            return out_a, total

        branches = [lambda operands: operands[-2:]] + [
            functools.partial(merged, plan) for plan in self.plans]
        out, lse = list(out), list(lse)
        for a, b, branch in self._pairs(me, source):
            out[a], lse[a] = jax.lax.switch(branch, branches, (
                q[a], k[b], v[b], _at(q_seg, a), _at(k_seg, b), out[a], lse[a]))
        return jnp.stack(out), jnp.stack(lse)

    def _pair_gradients(self, q, q_seg, keys, me, source, out, lse, d_out):
        """float32 (d_query, d_key, d_value) through the key chunks of `source`."""
        k, v, k_seg = keys

        def skipped(operands):
            q_a, k_b, v_b = operands[:3]
            return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q_a, k_b, v_b))

        def gradients(plan, operands):
            q_a, k_b, v_b, qs_a, ks_b, out_a, lse_a, d_a = operands
            inputs = ScoreInputs(query_segments=qs_a, key_segments=ks_b)
            return blocked_attention_backward(q_a, k_b, v_b, inputs, out_a, lse_a, d_a,
                                              plan=plan, **self.tiles)

        branches = [skipped] + [functools.partial(gradients, plan) for plan in self.plans]
        d_q = [jnp.zeros(x.shape, jnp.float32) for x in q]
        d_k = [jnp.zeros(x.shape, jnp.float32) for x in k]
        d_v = [jnp.zeros(x.shape, jnp.float32) for x in v]
        for a, b, branch in self._pairs(me, source):
            dq, dk, dv = jax.lax.switch(branch, branches, (
                q[a], k[b], v[b], _at(q_seg, a), _at(k_seg, b), out[a], lse[a], d_out[a]))
            d_q[a], d_k[b], d_v[b] = d_q[a] + dq, d_k[b] + dk, d_v[b] + dv
        return jnp.stack(d_q), jnp.stack(d_k), jnp.stack(d_v)

    # Forward and backward ----------------------------------------------------------------------

    def _attend(self, q, k, v, q_seg, k_seg):
        return self._forward(q, k, v, q_seg, k_seg)[0]

    def _forward(self, q, k, v, q_seg, k_seg):
        """q [c, B, K, G, Cq, D] (scaled), k, v [c, B, K, Ck, D], ids [c, B, C·] or None ->
        float32 out [c, B, K, G, Cq, Dv] and the residuals of the backward pass."""
        n, me = self.layout.devices, jax.lax.axis_index(self.axis)

        def step(s, carry):
            state, out, lse = carry
            source = (me - s) % n
            keys = self._keys_at(state, source)
            state = self._pass_on(state)  # independent of this step's compute: may overlap
            out, lse = self._merge_pairs(q, q_seg, keys, me, source, out, lse)
            return state, out, lse

        rows = q.shape[:-1]
        init = (self._start((k, v, k_seg)),
                jnp.zeros((*rows, v.shape[-1]), jnp.float32),
                jnp.full(rows, NO_KEYS_LOG_SUM_EXP, jnp.float32))
        _, out, lse = jax.lax.fori_loop(0, n, step, init)
        return out, (q, k, v, q_seg, k_seg, out, lse)

    def _backward(self, residuals, d_out):
        q, k, v, q_seg, k_seg, out, lse = residuals
        n, me = self.layout.devices, jax.lax.axis_index(self.axis)
        d_out = d_out.astype(jnp.float32)
        zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        ring = self.exchange == "ring"

        def step(s, carry):
            # ring: d_keys travels with the keys and is home after n hops; gather: one slot
            # per source device, summed over devices by psum_scatter at the end.
            state, d_keys, d_q = carry
            source = (me - s) % n
            keys = self._keys_at(state, source)
            dq, dk, dv = self._pair_gradients(q, q_seg, keys, me, source, out, lse, d_out)
            if ring:
                d_keys = self._pass_on((d_keys[0] + dk, d_keys[1] + dv))
            else:
                d_keys = (d_keys[0].at[source].add(dk), d_keys[1].at[source].add(dv))
            return self._pass_on(state), d_keys, d_q + dq

        d_keys = zeros if ring else tuple(jnp.zeros((n, *x.shape), x.dtype) for x in zeros)
        init = (self._start((k, v, k_seg)), d_keys, jnp.zeros(q.shape, jnp.float32))
        _, d_keys, d_q = jax.lax.fori_loop(0, n, step, init)
        if not ring:
            d_keys = jax.lax.psum_scatter(d_keys, self.axis)
        d_k, d_v = d_keys
        return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None


def _at(ids: jax.Array | None, index: int) -> jax.Array | None:
    return None if ids is None else ids[index]


def _context_lengths(platform, case):
    # Self-attention whose length cuts into 2 chunks per device (causal load balance).
    chunks = case.sequence_devices * (1 if case.spec is None else 2)
    if case.q_len != case.kv_len or case.q_len % chunks:
        return (f"q_len == kv_len, divisible by {chunks} chunks "
                f"(got {case.q_len} and {case.kv_len})")


def _run(call: Call) -> jax.Array:
    query_ids, key_ids = call_segment_ids(call) or (None, None)
    return context_parallel_attention(call.query, call.key, call.value, mesh=call.mesh,
                                      spec=call.spec, scale=call.scale,
                                      query_segment_ids=query_ids, key_segment_ids=key_ids,
                                      block_sizes=call.block_sizes, softcap=call.softcap)


# Tried first on every platform: under a mesh that splits the sequence, attention that can run
# context-parallel does; its tiles use the blocked kernel (which soft-caps). The mesh is the
# first need, so that selection without one stops there.
_SEQUENCE_SPLIT = at_least("sequence_devices", 2,
                           'a mesh with a "sequence" axis of size >= 2 (inside jax.set_mesh)')
KERNEL = Kernel("context_parallel", _run,
                needs=(_SEQUENCE_SPLIT, without("has_bias", "bias"),
                       without("has_sinks", "sinks"), key_mask_only, _context_lengths))
