"""Attention over a paged KV cache (`tfx.ops.paged`): queries read their sequence's keys
through a page table instead of from one contiguous array per sequence.

Visibility comes from positions alone. A paged cache stores the token at true position p of a
sequence at logical slot p (page p // page_size of its page table, offset p % page_size), with
no gaps, so a query at position p sees exactly the logical slots 0..p: causal attention needs no
mask array, and page-table entries past the furthest query are never read as visible (they may
hold anything, e.g. -1 for "no page").

Implementations (records in `PAGED_KERNELS`, chosen by `select_paged_attention`):
- "reference": gather every page of each sequence into [batch, num_kv_heads, kv_len, head_dim]
  and run `cached_attention` (the definition the others are tested against);
- "blocked": a loop over logical pages with an online softmax (Rabe & Staats), reading a block
  of pages (BLOCK_TOKENS keys) of each sequence per iteration; the gathered cache is never
  materialised, and the loop stops at the furthest query's block (a dynamic trip count), so
  its cost follows the longest live sequence, not the page table's width. Inference only: a
  dynamic loop has no reverse mode;
- "pallas_gpu" / "pallas_tpu": jax's Pallas paged-attention kernels
  (`jax.experimental.pallas.ops.gpu.paged_attention`, `...tpu.paged_attention`), for decoding
  steps (one query per sequence). Forced on CPU, "pallas_gpu" runs in the Pallas interpreter
  (slow; for tests); "pallas_tpu" needs a TPU.

Attention sinks (GPT-OSS: a learned logit per head, a key of value zero in every softmax) are
taken by "reference" and "blocked", whose online softmax starts from the sink; the Pallas
kernels refuse them, and selection then skips them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops import _checks
from tfx.ops.attention.blocked_attention import soft_cap
from tfx.ops.attention.dispatch import cached_attention
from tfx.ops.attention.kernel import Kernel, dtype_in, on, without, x64_disabled
from tfx.ops.backends import current_platform, platform_name

__all__ = ["PAGED_IMPLEMENTATIONS", "PAGED_KERNELS", "PagedCase", "gather_pages", "paged_attention",
           "paged_unavailable", "select_paged_attention"]

_MASKED_LOGIT = float(np.finfo(np.float32).min)
# Keys per iteration of the blocked kernel (whole pages; one page when pages are larger).
BLOCK_TOKENS = 128


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "implementation"))
def paged_attention(query: jax.Array, key_pages: jax.Array, value_pages: jax.Array,
                    page_table: jax.Array, query_positions: jax.Array, *,
                    scale: float | None = None, softcap: float | None = None,
                    implementation: str | None = None,
                    sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention of new queries over their sequences' paged keys and values.

    Args:
      query: [batch, q_len, num_heads, head_dim].
      key_pages: [num_kv_heads, num_pages, page_size, head_dim], the layer's page pool (the
        layout of jax's Pallas paged-attention kernels); num_kv_heads divides num_heads (MHA,
        GQA, MQA).
      value_pages: [num_kv_heads, num_pages, page_size, value_dim], same dtype as key_pages.
      page_table: int [batch, pages_per_seq], the pool page holding each logical page of each
        sequence; entries past a sequence's last query are ignored (any value).
      query_positions: int [batch, q_len], the true position p of each query, which sees the
        keys at logical positions 0..p (they must have been written); p < 0 marks padding,
        whose output is zeros.
      scale: score multiplier (default 1/sqrt(head_dim)).
      softcap: logit soft-capping (Gemma 2) as in `tfx.ops.dot_product_attention`, or None.
      implementation: one of PAGED_IMPLEMENTATIONS, or None for the platform's best
        (`select_paged_attention`). Forcing one that cannot run this call
        raises a ValueError naming what it lacks.
      sinks: optional float [num_heads], a sink logit per head (GPT-OSS), as in
        `tfx.ops.dot_product_attention`; "reference" and "blocked" take it.
    Returns:
      [batch, q_len, num_heads, value_dim] in the dtype of value_pages.
    """
    _validate(query, key_pages, value_pages, page_table, query_positions, scale, softcap, sinks)
    case = PagedCase(q_len=query.shape[1], pages_per_seq=page_table.shape[1],
                     page_size=key_pages.shape[2], head_dim=query.shape[3],
                     value_dim=value_pages.shape[3], dtype=np.dtype(query.dtype),
                     has_sinks=sinks is not None)
    platform = current_platform()
    if implementation is None:
        implementation = select_paged_attention(platform, case)
    elif implementation not in PAGED_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {PAGED_IMPLEMENTATIONS} or None, got "
                         f"{implementation!r}")
    elif missing := paged_unavailable(implementation, platform, case):
        raise ValueError(f"implementation={implementation!r} cannot run this call: it needs "
                         + "; ".join(missing))
    scale = 1.0 / math.sqrt(query.shape[3]) if scale is None else scale
    pages = jnp.clip(page_table.astype(jnp.int32), 0, key_pages.shape[1] - 1)
    positions = query_positions.astype(jnp.int32)
    run = PAGED_KERNELS[implementation].run
    if implementation == "pallas_gpu":
        run = functools.partial(run, interpret=platform == "cpu")
    if sinks is not None:  # only the kernels that take sinks get here with them
        run = functools.partial(run, sinks=sinks)
    return run(query, key_pages, value_pages, pages, positions, scale, softcap)


def _validate(query, key_pages, value_pages, page_table, query_positions, scale, softcap,
              sinks):
    _checks.floating("query", query, ndim=4, layout="[batch, q_len, num_heads, head_dim]")
    _checks.floating("key_pages", key_pages, ndim=4,
                     layout="[num_kv_heads, num_pages, page_size, head_dim]")
    _checks.floating("value_pages", value_pages, ndim=4,
                     layout="[num_kv_heads, num_pages, page_size, value_dim]")
    _checks.integer("page_table", page_table, ndim=2, layout="[batch, pages_per_seq]")
    _checks.integer("query_positions", query_positions, ndim=2, layout="[batch, q_len]")
    batch, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key_pages.shape[0]
    if key_pages.shape[3] != head_dim or value_pages.shape[:3] != key_pages.shape[:3]:
        raise ValueError(f"key_pages {key_pages.shape} and value_pages {value_pages.shape} must "
                         f"be [num_kv_heads, num_pages, page_size, head_dim={head_dim}] (value: "
                         "any value_dim)")
    if key_pages.dtype != value_pages.dtype:
        raise TypeError(f"key_pages ({key_pages.dtype}) and value_pages ({value_pages.dtype}) "
                        "must have one dtype")
    if num_kv_heads < 1 or num_heads % num_kv_heads or min(key_pages.shape[1:3]) < 1:
        raise ValueError(f"key_pages must have num_kv_heads >= 1 dividing num_heads "
                         f"({num_heads}) and at least one page of size >= 1, got "
                         f"{key_pages.shape}")
    if page_table.shape[0] != batch or page_table.shape[1] < 1:
        raise ValueError(f"page_table must be [batch={batch}, pages_per_seq >= 1], got "
                         f"{page_table.shape}")
    if query_positions.shape != (batch, q_len):
        raise ValueError(f"query_positions must be [batch, q_len] = {(batch, q_len)}, got "
                         f"{query_positions.shape}")
    if scale is not None:
        _checks.finite_positive_float("scale", scale)
    if softcap is not None:
        _checks.finite_positive_float("softcap", softcap)
    if sinks is not None:
        _checks.floating("sinks", sinks, ndim=1, layout="[num_heads]")
        if sinks.shape[0] != num_heads:
            raise ValueError(f"sinks must be [num_heads] = ({num_heads},), got "
                             f"{tuple(sinks.shape)}")


def gather_pages(pool: jax.Array, page_table: jax.Array) -> jax.Array:
    """The pages of each sequence in logical order, contiguous.

    Args:
      pool: [num_kv_heads, num_pages, page_size, dim].
      page_table: int [batch, pages_per_seq] of pool pages (in range).
    Returns:
      [batch, num_kv_heads, pages_per_seq * page_size, dim], heads-major like a dense cache.
    """
    heads, _, page_size, dim = pool.shape
    batch, pages_per_seq = page_table.shape
    gathered = jnp.swapaxes(pool[:, page_table], 0, 1)  # [batch, heads, pages, page_size, dim]
    return gathered.reshape(batch, heads, pages_per_seq * page_size, dim)


def _reference(query, key_pages, value_pages, pages, positions, scale, softcap, sinks=None):
    """Gather, then the dense cached-attention maths with a causal mask from positions."""
    kv_len = pages.shape[1] * key_pages.shape[2]
    mask = jnp.arange(kv_len)[None, None, None, :] <= positions[:, None, :, None]
    return cached_attention(query, gather_pages(key_pages, pages),
                            gather_pages(value_pages, pages), mask=mask, scale=scale,
                            softcap=softcap, sinks=sinks)


def _blocked(query, key_pages, value_pages, pages, positions, scale, softcap, sinks=None):
    """A block of logical pages of every sequence per iteration, with an online softmax (which
    starts from the sink, when there are sinks: its score is the first maximum, its weight
    exp(0) = 1 the first total, its value zero)."""
    batch, q_len, num_heads, head_dim = query.shape
    num_kv_heads, _, page_size, value_dim = value_pages.shape
    groups = num_heads // num_kv_heads
    query = query.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    # Blocks of about BLOCK_TOKENS keys: fewer loop iterations than one page each (each costs
    # a fixed overhead on CPU), still small next to a sequence. The table is padded with page
    # 0 to whole blocks; those slots lie past every query, so they are never visible.
    per_block = max(1, min(BLOCK_TOKENS // page_size, pages.shape[1]))
    pages = jnp.pad(pages, ((0, 0), (0, -pages.shape[1] % per_block)))
    block = per_block * page_size
    # Blocks after the furthest query's are invisible to every query: the loop ends there.
    stop = (jnp.max(positions) + block) // block

    def gather(pool, i):  # [k, pages, s, d] -> [k, b, block, d]
        chosen = jax.lax.dynamic_slice_in_dim(pages, i * per_block, per_block, axis=1)
        return pool[:, chosen].reshape(num_kv_heads, batch, block, pool.shape[-1])

    def step(i, carry):
        out, row_max, total = carry  # [b, k, g, t, dv], [b, k, g, t], [b, k, g, t]; float32
        key, value = gather(key_pages, i), gather(value_pages, i)
        scores = jnp.einsum("btkgd,kbsd->bkgts", query, key,
                            preferred_element_type=jnp.float32) * jnp.float32(scale)
        scores, _ = soft_cap(scores, softcap)
        visible = (i * block + jnp.arange(block) <= positions[..., None])[:, None, None]
        scores = jnp.where(visible, scores, _MASKED_LOGIT)
        new_max = jnp.maximum(row_max, scores.max(axis=-1))
        weights = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
        correction = jnp.exp(row_max - new_max)
        out = out * correction[..., None] + jnp.einsum(
            "bkgts,kbsd->bkgtd", weights.astype(value.dtype), value,
            preferred_element_type=jnp.float32)
        return out, new_max, total * correction + weights.sum(axis=-1)

    stats = (batch, num_kv_heads, groups, q_len)
    if sinks is None:
        row_max, total = jnp.full(stats, _MASKED_LOGIT), jnp.zeros(stats, jnp.float32)
    else:
        sinks = sinks.astype(jnp.float32).reshape(1, num_kv_heads, groups, 1)
        row_max, total = jnp.broadcast_to(sinks, stats), jnp.ones(stats, jnp.float32)
    out, _, total = jax.lax.fori_loop(0, stop, step, (
        jnp.zeros((*stats, value_dim), jnp.float32), row_max, total))
    out = out / jnp.where(total == 0.0, 1.0, total)[..., None]  # a row seeing nothing: zeros
    out = jnp.moveaxis(out, 3, 1).reshape(batch, q_len, num_heads, value_dim)
    return out.astype(value_pages.dtype)


def _pallas_gpu(query, key_pages, value_pages, pages, positions, scale, softcap, *,
                interpret: bool):
    """jax's Pallas GPU kernel: one query per sequence, keys 0..length-1."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    pages_per_seq = pages.shape[1]
    splits = math.gcd(pages_per_seq, 16)  # the kernel splits the pages evenly
    per_block = math.gcd(pages_per_seq // splits, 8)
    lengths = positions[:, 0] + 1
    out = gpu_paged.paged_attention(
        (query[:, 0] * scale).astype(query.dtype), key_pages, value_pages, pages,
        jnp.maximum(lengths, 1), k_splits=splits, pages_per_compute_block=per_block,
        attn_logits_soft_cap=softcap, interpret=interpret)
    return jnp.where(lengths[:, None, None] > 0, out, 0).astype(value_pages.dtype)[:, None]


def _pallas_tpu(query, key_pages, value_pages, pages, positions, scale, softcap):
    """jax's Pallas TPU kernel: one query per sequence, keys 0..length-1."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

    lengths = positions[:, 0] + 1
    out = tpu_paged((query[:, 0] * scale).astype(query.dtype), key_pages, value_pages,
                    jnp.maximum(lengths, 1), pages,
                    pages_per_compute_block=math.gcd(pages.shape[1], 8),
                    attn_logits_soft_cap=softcap)
    return jnp.where(lengths[:, None, None] > 0, out, 0).astype(value_pages.dtype)[:, None]


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """The static facts of one paged-attention call: query length, the page table's width,
    page size, head and value dims, the dtype, and whether the heads have sinks."""

    q_len: int
    pages_per_seq: int
    page_size: int
    head_dim: int
    value_dim: int
    dtype: np.dtype
    has_sinks: bool = False


def _one_query(platform, case):
    if case.q_len != 1:
        return f"one query per sequence (a decoding step; got q_len {case.q_len})"


def _paged_gpu_shapes(platform, case):
    # Triton's dot needs 16 on each side; the kernel reads keys and values with one layout.
    if case.head_dim % 16 or case.value_dim != case.head_dim or case.page_size % 16:
        return (f"head_dim a multiple of 16, value_dim == head_dim and page_size a multiple of "
                f"16 (got {case.head_dim}, {case.value_dim}, {case.page_size})")


def _paged_tpu_shapes(platform, case):
    # The TPU kernel tiles a page's tokens over the 128 lanes of a vector register.
    if case.value_dim != case.head_dim or case.page_size % 128:
        return (f"value_dim == head_dim and page_size a multiple of 128 (got {case.value_dim}, "
                f"{case.head_dim}, {case.page_size})")


# The paged kernels, in the order implementation=None tries them: the platform's Pallas kernel
# when it can run (decoding steps), else "blocked". The blocked loop reads only the pages up to
# the furthest query, where "reference" gathers the whole page table's width: measured on CPU
# (char-gpt shape, batch 8, 1024-token table, ~300 tokens live) a decoding step took 7.1 ms
# against 16.9 ms. A new paged kernel is its function and one line here.
PAGED_KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("pallas_gpu", _pallas_gpu, platforms=("gpu",),
           needs=(on("gpu", "cpu"), dtype_in("float16", "bfloat16", "float32"), _one_query,
                  _paged_gpu_shapes, x64_disabled, without("has_sinks", "sinks"))),
    Kernel("pallas_tpu", _pallas_tpu, platforms=("tpu",),
           needs=(on("tpu"), dtype_in("float32", "bfloat16"), _one_query, _paged_tpu_shapes,
                  without("has_sinks", "sinks"))),
    Kernel("blocked", _blocked),
    Kernel("reference", _reference, platforms=()),
)}
PAGED_IMPLEMENTATIONS = tuple(PAGED_KERNELS)


def paged_unavailable(implementation: str, platform: str, case: PagedCase) -> list[str]:
    """What paged `implementation` needs that this call lacks on `platform` (empty: runs)."""
    return PAGED_KERNELS[implementation].missing(platform_name(platform), case)


def select_paged_attention(platform: str, case: PagedCase) -> str:
    """The paged-attention kernel for `case` on `platform`: the first of `PAGED_KERNELS` tried
    there whose needs hold (the platform's Pallas kernel for decoding steps, else "blocked")."""
    platform = platform_name(platform)
    for record in PAGED_KERNELS.values():
        if record.tried_by_default(platform, case) and record.runs(platform, case):
            return record.name
    raise AssertionError("the blocked kernel runs every call")
