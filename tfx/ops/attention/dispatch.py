"""Scaled dot-product attention: MHA, GQA and MQA, masks, bias, sparsity, self and cross.

The public entry point validates its arguments, folds `is_causal` and `sparsity` into one static
spec, selects a kernel record (`tfx.ops.attention.kernel.Kernel`) from the table for the
platform, and runs it: the table that selects a kernel is the one that runs it. "reference"
materialises the [B, H, T, S] scores and is the definition every faster kernel is tested
against.

Selection is pure Python on static facts (shapes, dtypes, which optional inputs are present,
the static mask spec), so it runs at trace time and is unit-tested by passing the platform name
("cpu", "gpu", "tpu") instead of reading `jax.default_backend()`.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops import _checks
from tfx.ops.attention import table
from tfx.ops.attention.context_parallel import SEQUENCE_AXIS
from tfx.ops.attention.kernel import AttentionCase, Call, Kernel, Need
from tfx.ops.attention.reference import key_query_scores, reference_attention
from tfx.ops.attention.table import IMPLEMENTATIONS
from tfx.ops.backends import PLATFORMS, current_platform, platform_name
from tfx.ops.sparse import Causal, SparsitySpec

__all__ = [
    "ATTENTION_NEEDS",
    "ATTENTION_PREFERENCE",
    "IMPLEMENTATIONS",
    "KERNELS",
    "attention_unavailable",
    "cached_attention",
    "dot_product_attention",
    "select_attention",
    "static_spec",
]


@functools.partial(
    jax.jit,
    static_argnames=("is_causal", "scale", "softcap", "sparsity", "implementation",
                     "block_sizes", "heads_major"),
)
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sparsity: SparsitySpec | None = None,
    query_segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
    implementation: str | None = None,
    block_sizes: tuple[int, int] | None = None,
    heads_major: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """softmax(cap(query·keyᵀ·scale) + bias, masked) · value, per head.

    Args:
      query: [batch, q_len, num_heads, head_dim], or one example [q_len, num_heads, head_dim]
        (as `jax.nn.dot_product_attention` takes it, so the op vmaps over a per-example
        function), with key and value likewise without batch, segment ids [length], bias
        and mask broadcastable to [num_heads, q_len, kv_len], and the result [q_len,
        num_heads, value_dim].
      key: [batch, kv_len, num_kv_heads, head_dim]; num_kv_heads divides num_heads (MHA: equal,
        GQA: fewer, MQA: one). Query heads h use key head h // (num_heads // num_kv_heads); K/V
        heads are never repeated in memory.
      value: [batch, kv_len, num_kv_heads, value_dim], same dtype as query and key.
      bias: optional float array broadcastable to [batch, num_heads, q_len, kv_len], added to the
        scaled scores (ALiBi, T5 relative bias, ...). A -inf entry hides its key exactly as a
        False in `mask` does.
      mask: optional bool array broadcastable to [batch, num_heads, q_len, kv_len];
        True = may attend.
      is_causal: query i sees keys j <= i (top-left aligned, as `jax.nn.dot_product_attention`).
        For cached decoding, where queries sit at the end of the keys, pass
        `tfx.ops.masks.causal_mask(query_positions, key_positions)` as `mask` instead.
      scale: multiplier of the scores; default 1/sqrt(head_dim).
      softcap: None (no cap), or a finite float > 0: logit soft-capping (Gemma 2), which maps
        each scaled score s to softcap·tanh(s / softcap) before the bias and the mask apply
        (the order of Hugging Face's Gemma 2). Static, like scale. Every implementation but
        "cudnn" and "pallas_gpu" takes it; with it, implementation=None never picks those two.
      sparsity: optional `tfx.ops.sparse` spec, top-left aligned like `is_causal`.
      query_segment_ids: optional int [batch, q_len] for packed sequences: a query sees only
        keys with the same segment id. Unlike an equivalent `mask`, it costs O(q_len + kv_len)
        memory, and the blocked path skips tiles where no segments meet.
      key_segment_ids: int [batch, kv_len]; defaults to `query_segment_ids` (self-attention).
      implementation: "reference" (materialises the [batch, heads, q_len, kv_len] scores),
        "blocked" (online softmax over tiles, O(q_len + kv_len) memory, skips tiles that the
        causal mask, `sparsity` or key padding leave empty, and tiles that `mask` or segment ids
        leave empty for the whole batch), "cudnn" (GPU), "pallas_gpu" (GPU), "splash" (TPU), or
        "context_parallel" (self-attention with the sequence split over the "sequence" axis
        of the mesh the call is traced under: `tfx.ops.attention.context_parallel`), or
        None: the fastest one that can run this call on `jax.default_backend()`, as tabled in
        `tfx.ops.attention.table` (context_parallel under a mesh whose "sequence" axis has 2 devices
        or more; on CPU: "blocked" when q_len·kv_len >= BLOCKED_MIN_SCORES, else
        "reference"). Forcing one that cannot run raises a ValueError naming what it lacks.
        "pallas_gpu" and "splash" forced on CPU run in Pallas interpret mode (slow; for tests).
      block_sizes: (block_q, block_k) tile sizes of the blocked path, each capped at its
        sequence length; default: chosen per call by `tfx.ops.attention.tile_sizes.choose_pieces`
        (BLOCK_Q x BLOCK_K without a static mask, smaller tiles where a sparse one leaves them
        emptier, and, without a bias, a strided pattern in two passes: its window, and its
        strided pairs in residue order). Given tiles run in one pass.
      heads_major: key and value are [batch, num_kv_heads, kv_len, dim], as KV caches store
        them: `cached_attention` then runs (reference maths, the few queries of a decoding
        step), which takes visibility from `mask` and `bias` only; `implementation` and
        `block_sizes` apply to the other layout.
      sinks: optional float [num_heads], a learned "attention sink" logit per head (GPT-OSS):
        each row's softmax also counts a key of score sinks[h] and value zero, so its weights
        over the real keys sum to less than one. Differentiable. "reference" and "blocked"
        take it; with it, implementation=None picks one of those.
    Returns:
      [batch, q_len, num_heads, value_dim] in the dtype of value. Scores and softmax statistics
      are float32 for every input dtype. A query row with no visible key (masked, hidden by a
      -inf bias, or kv_len = 0) returns zeros and has finite (zero) gradients; an empty batch,
      q_len, num_heads or value_dim gives the empty result. num_kv_heads and head_dim must be
      >= 1.
    """
    if getattr(query, "ndim", None) == 3:  # one example, as jax.nn.dot_product_attention takes it
        return _one_example(query, key, value, bias=bias, mask=mask, is_causal=is_causal,
                            scale=scale, softcap=softcap, sparsity=sparsity,
                            query_segment_ids=query_segment_ids,
                            key_segment_ids=key_segment_ids, implementation=implementation,
                            block_sizes=block_sizes, heads_major=heads_major, sinks=sinks)
    if heads_major:
        if is_causal or sparsity is not None or query_segment_ids is not None:
            raise ValueError("heads-major keys take visibility from mask and bias only: "
                             "is_causal, sparsity and segment ids must be unset")
        return cached_attention(query, key, value, bias=bias, mask=mask, scale=scale,
                                softcap=softcap, sinks=sinks)
    cross_segments = key_segment_ids is not None
    if key_segment_ids is None:
        key_segment_ids = query_segment_ids
    _validate(query, key, value, bias, mask, is_causal, scale, softcap, sparsity)
    _validate_sinks(sinks, query.shape[2])
    block_sizes = _block_sizes(block_sizes, query.shape[1], key.shape[1])
    _validate_segments(query_segment_ids, key_segment_ids, query.shape[:2], key.shape[:2])
    kv_len, value_dim = key.shape[1], value.shape[3]
    spec = static_spec(is_causal, sparsity)
    mesh = jax.sharding.get_abstract_mesh()
    case = _case(query, key, value, bias, mask, query_segment_ids is not None, cross_segments,
                 spec, mesh, has_softcap=softcap is not None, has_sinks=sinks is not None)
    platform = current_platform()
    implementation = _resolve_implementation(implementation, platform, case)
    if scale is None:
        scale = 1.0 / float(np.sqrt(query.shape[3]))
    if _nothing_to_attend(query.shape, kv_len, value_dim):
        return jnp.zeros((*query.shape[:3], value_dim), value.dtype)
    segments = (query_segment_ids, key_segment_ids)
    call = Call(query, key, value, bias, mask, segments, spec, scale, softcap, mesh, block_sizes,
                platform, sinks)
    return KERNELS[implementation].run(call)


def _one_example(query, key, value, *, bias, mask, query_segment_ids, key_segment_ids,
                 **static) -> jax.Array:
    """`dot_product_attention` of one example: query [q_len, num_heads, head_dim], key and
    value [kv_len, num_kv_heads, dim] (or heads-major), segment ids [q_len] / [kv_len]; bias
    and mask broadcastable to [num_heads, q_len, kv_len]. Returns [q_len, num_heads,
    value_dim]: the batched result of a batch of one."""
    for name, x in (("key", key), ("value", value)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dims like query {query.shape} (one example), "
                             f"got shape {x.shape}")
    for name, ids in (("query_segment_ids", query_segment_ids),
                      ("key_segment_ids", key_segment_ids)):
        if ids is not None and ids.ndim != 1:
            raise ValueError(f"{name} of one example must be 1-D [length], got shape "
                             f"{ids.shape}")
    batched = [None if x is None else x[None] for x in (query, key, value, query_segment_ids,
                                                        key_segment_ids)]
    # [heads, q_len, kv_len] broadcasts to [batch, heads, q_len, kv_len] as it is.
    out = dot_product_attention(*batched[:3], bias=bias, mask=mask,
                                query_segment_ids=batched[3], key_segment_ids=batched[4],
                                **static)
    return out[0]


@functools.partial(jax.jit, static_argnames=("scale", "softcap"))
def cached_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                     bias: jax.Array | None = None, mask: jax.Array | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Attention of a few new queries over a KV cache stored heads-major (`tfx.ops.kv_cache`).

    The same maths as `dot_product_attention(implementation="reference")`; only the key/value
    layout differs. Heads-major lets XLA contract every head without first transposing the whole
    cache, which on CPU made decoding attention ~2.5x slower in the [batch, kv_len, heads, dim]
    layout (measured: GPT-2 width 384, batch 8, 192 cached tokens). The scores are computed as
    K·Qᵀ (`tfx.ops.attention.reference.key_query_scores`), which reads the cache as stored at
    batch 1 and with one KV head too.

    Args:
      query: [batch, q_len, num_heads, head_dim].
      key: [batch, num_kv_heads, kv_len, head_dim].
      value: [batch, num_kv_heads, kv_len, value_dim].
      bias: as in `dot_product_attention` (a -inf bias hides its key).
      mask: as in `dot_product_attention`.
      scale: as in `dot_product_attention`.
      softcap: as in `dot_product_attention` (logit soft-capping, Gemma 2).
      sinks: as in `dot_product_attention` (a sink logit per head, GPT-OSS).
    Returns:
      [batch, q_len, num_heads, value_dim] in the dtype of value; zeros for rows that see no
      key, and for kv_len = 0.
    """
    _checks.floating("query", query, ndim=4, layout="[batch, q_len, num_heads, head_dim]")
    _checks.floating("key", key, ndim=4, layout="[batch, num_kv_heads, kv_len, head_dim]")
    _checks.floating("value", value, ndim=4, layout="[batch, num_kv_heads, kv_len, value_dim]")
    batch, q_len, num_heads, head_dim = query.shape
    if key.shape[0] != batch or key.shape[3] != head_dim or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"key {key.shape} and value {value.shape} must be [batch={batch}, "
                         f"num_kv_heads dividing {num_heads}, kv_len, head_dim={head_dim}]")
    _check_heads(num_heads, key.shape[1], head_dim)
    scores_shape = (batch, num_heads, q_len, key.shape[2])
    axes = "[batch, num_heads, q_len, kv_len]"
    if bias is not None:
        _checks.broadcastable("bias", bias.shape, scores_shape, axes)
    if mask is not None:
        _checks.boolean("mask", mask, max_ndim=4)
        _checks.broadcastable("mask", mask.shape, scores_shape, axes)
    _check_scores(scale, softcap)
    _validate_sinks(sinks, num_heads)
    if scale is None:
        scale = 1.0 / float(np.sqrt(head_dim))
    if _nothing_to_attend(query.shape, key.shape[2], value.shape[3]):
        return jnp.zeros((*query.shape[:3], value.shape[3]), value.dtype)
    return reference_attention(query, key, value, bias, mask, (scale, softcap),
                                key_query_scores, sinks)


def _check_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Require num_kv_heads >= 1 dividing num_heads, and head_dim >= 1 (the default scale is
    1/sqrt(head_dim)); num_heads may be 0 (an empty output)."""
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads (key and value dim 2) must be >= 1, got {num_kv_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    if head_dim < 1:
        raise ValueError(f"head_dim (query and key dim 3) must be >= 1, got {head_dim}")


def _case(query, key, value, bias, mask, has_segments: bool, cross_segments: bool, spec,
          mesh: jax.sharding.AbstractMesh, *, has_softcap: bool,
          has_sinks: bool) -> AttentionCase:
    """The static facts of a call that `select_attention` selects its kernel by."""
    return AttentionCase(
        dtype=query.dtype, q_len=query.shape[1], kv_len=key.shape[1], num_heads=query.shape[2],
        num_kv_heads=key.shape[2], head_dim=query.shape[3], value_dim=value.shape[3],
        has_bias=bias is not None, has_mask=mask is not None,
        key_mask=mask is not None and _masks_keys_only(mask.shape),
        has_segments=has_segments, cross_segments=cross_segments, spec=spec,
        sequence_devices=_sequence_devices(mesh), has_softcap=has_softcap, has_sinks=has_sinks)


def _sequence_devices(mesh: jax.sharding.AbstractMesh) -> int:
    """The size of the mesh's sequence axis (1 without a mesh or without that axis)."""
    return 1 if mesh.empty else dict(mesh.shape).get(SEQUENCE_AXIS, 1)


def _nothing_to_attend(query_shape: tuple[int, ...], kv_len: int, value_dim: int) -> bool:
    """Whether the output is empty or no key exists. Without keys every row is fully masked,
    which returns zeros by the documented rule; the kernels need at least one key and one row."""
    return 0 in (*query_shape[:3], kv_len, value_dim)


def _resolve_implementation(implementation: str | None, platform: str,
                            case: AttentionCase) -> str:
    if implementation is None:
        return select_attention(platform, case)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}"
        )
    missing = attention_unavailable(implementation, platform, case)
    if missing:
        raise ValueError(f"implementation={implementation!r} cannot run this call; it needs "
                         + "; ".join(missing))
    return implementation


def _load(name: str, reference: str) -> Kernel:
    """The record that the table's line `name: "module:attribute"` points at."""
    module, _, attribute = reference.partition(":")
    record = getattr(importlib.import_module(module), attribute)
    if record.name != name:
        raise ValueError(f"the table's kernel {name!r} points at the record of {record.name!r}")
    return record


# name -> record, in the order implementation=None tries them.
KERNELS: dict[str, Kernel] = {name: _load(name, ref) for name, ref in table.KERNELS.items()}
# Views of the records: what each kernel needs, and the platform-specific kernels per platform.
ATTENTION_NEEDS: dict[str, tuple[Need, ...]] = {k.name: k.needs for k in KERNELS.values()}
ATTENTION_PREFERENCE: dict[str, tuple[str, ...]] = {
    platform: tuple(k.name for k in KERNELS.values() if k.platforms and platform in k.platforms)
    for platform in PLATFORMS
}


def attention_unavailable(implementation: str, platform: str, case: AttentionCase) -> list[str]:
    """What `implementation` needs that this call lacks on `platform` (empty when it can run)."""
    return KERNELS[implementation].missing(platform_name(platform), case)


def select_attention(platform: str, case: AttentionCase) -> str:
    """The fastest attention kernel that can run `case` on `platform`.

    Args:
      platform: "cpu", "gpu" or "tpu", as `jax.default_backend()` names them (others get tfx's
        portable kernels).
      case: the static facts of the call.
    Returns:
      the first name of `tfx.ops.attention.table.KERNELS` tried on the platform whose needs
      hold: "context_parallel", "cudnn", "pallas_gpu", "splash", "blocked" or "reference".
    """
    platform = platform_name(platform)
    for record in KERNELS.values():
        if record.tried_by_default(platform, case) and record.runs(platform, case):
            return record.name
    raise AssertionError("the reference kernel runs every call")  # it ends the table


def _masks_keys_only(shape: tuple[int, ...]) -> bool:
    """Whether a mask of this shape (broadcastable to [batch, heads, q_len, kv_len]) can only
    mask keys: its heads and query dims are 1 (or absent)."""
    full = (1,) * (4 - len(shape)) + tuple(shape)
    return full[1] == full[2] == 1


def static_spec(is_causal: bool, sparsity: SparsitySpec | None) -> SparsitySpec | None:
    """The trace-time part of the mask as one sparse spec (None when everything is visible)."""
    if is_causal:
        return Causal() if sparsity is None else Causal() & sparsity
    return sparsity


def _block_sizes(block_sizes, q_len: int, kv_len: int) -> tuple[int, int] | None:
    """The caller's tiles checked and capped at the lengths; None stays None (chosen later, by
    the kernel that tiles)."""
    if block_sizes is None:
        return None
    if not isinstance(block_sizes, tuple) or len(block_sizes) != 2:
        raise TypeError(f"block_sizes must be a (block_q, block_k) tuple, got {block_sizes!r}")
    block_q = _checks.positive_int("block_sizes[0] (block_q)", block_sizes[0])
    block_k = _checks.positive_int("block_sizes[1] (block_k)", block_sizes[1])
    return min(block_q, q_len), min(block_k, kv_len)


def _validate_segments(query_segments, key_segments, query_batch_len, key_batch_len) -> None:
    if query_segments is None:
        if key_segments is not None:
            raise ValueError("key_segment_ids needs query_segment_ids")
        return
    for name, ids, shape, axes in (
        ("query_segment_ids", query_segments, query_batch_len, "[batch, q_len]"),
        ("key_segment_ids", key_segments, key_batch_len, "[batch, kv_len]"),
    ):
        _checks.integer(name, ids, ndim=2, layout=axes)
        if tuple(ids.shape) != tuple(shape):
            raise ValueError(f"{name} of shape {tuple(ids.shape)} must be {axes} = {tuple(shape)}")


def _validate_sinks(sinks, num_heads: int) -> None:
    """sinks: None or a floating array [num_heads]."""
    if sinks is None:
        return
    _checks.floating("sinks", sinks, ndim=1, layout="[num_heads]")
    if sinks.shape[0] != num_heads:
        raise ValueError(f"sinks must be [num_heads] = ({num_heads},), got {tuple(sinks.shape)}")


def _check_scores(scale, softcap) -> None:
    """scale: None or a float > 0; softcap: None or a finite float > 0."""
    if scale is not None:
        _checks.positive_float("scale", scale)
    if softcap is not None:
        _checks.finite_positive_float("softcap", softcap)


def _validate(query, key, value, bias, mask, is_causal, scale, softcap, sparsity) -> None:
    _checks.floating("query", query, ndim=4, layout="[batch, q_len, num_heads, head_dim]")
    _checks.floating("key", key, ndim=4, layout="[batch, kv_len, num_kv_heads, head_dim]")
    _checks.floating("value", value, ndim=4, layout="[batch, kv_len, num_kv_heads, value_dim]")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            "query, key and value must share a dtype, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}"
        )
    batch, q_len, num_heads, head_dim = query.shape
    if key.shape[0] != batch:
        raise ValueError(f"key batch ({key.shape[0]}) must equal query batch ({batch})")
    if key.shape[3] != head_dim:
        raise ValueError(f"key head_dim ({key.shape[3]}) must equal query head_dim ({head_dim})")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"value shape {value.shape} must match key shape {key.shape} in "
            "[batch, kv_len, num_kv_heads]"
        )
    num_kv_heads = key.shape[2]
    _check_heads(num_heads, num_kv_heads, head_dim)
    scores_shape = (batch, num_heads, q_len, key.shape[1])
    axes = "[batch, num_heads, q_len, kv_len]"
    if bias is not None:
        _checks.floating("bias", bias)
        _checks.broadcastable("bias", bias.shape, scores_shape, axes)
    if mask is not None:
        _checks.boolean("mask", mask, max_ndim=4)
        _checks.broadcastable("mask", mask.shape, scores_shape, axes)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    _check_scores(scale, softcap)
    if sparsity is not None and not isinstance(sparsity, SparsitySpec):
        raise TypeError(
            f"sparsity must be a tfx.ops.sparse spec or None, got {type(sparsity).__name__}"
        )
