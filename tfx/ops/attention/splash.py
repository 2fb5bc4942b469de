"""TPU splash attention: tfx sparse specs as splash mask objects, and the splash kernel call.

Splash (`jax.experimental.pallas.ops.tpu.splash_attention`) skips the tiles its mask leaves
empty, like tfx's blocked kernel, but reads the mask from its own lazy mask objects. `splash_mask`
maps each spec onto them: computable masks (causal, local window) where a spec has one, logical
combinations of the parts, and a NumPy mask of `spec.dense` as the fallback.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from tfx.ops.attention.kernel import Call, Kernel, dtype_in, key_mask_only, on, without
from tfx.ops.sparse import (
    Causal,
    Intersection,
    LeadingKeys,
    SlidingWindow,
    SparsitySpec,
    Union,
)

__all__ = ["KERNEL", "PALLAS_LENGTH_MULTIPLE", "call_segment_ids", "key_mask_as_segments",
           "splash_attention", "splash_block", "splash_mask"]

# Each query row starts with this "attention sink" logit (a score with no value): far above
# splash's masked logit (-0.7 * float32 max) and far below any real score. A row that sees a
# key is unchanged (exp(sink - max) is exactly 0), and a row that sees none gets a softmax sum
# of 1 and an output of 0 with zero gradients, where splash alone would divide by zero.
_SINK_LOGIT = -0.35 * float(np.finfo(np.float32).max)
_BLOCK_CHOICES = (512, 256, 128)  # the first one dividing a length is its tile size


def splash_mask(spec: SparsitySpec | None, q_len: int, kv_len: int) -> masks.Mask:
    """`spec` (top-left aligned, q_offset 0) as a splash mask of shape (q_len, kv_len)."""
    shape = (q_len, kv_len)
    if spec is None:
        return masks.FullMask(shape)
    if spec == Causal():
        return masks.CausalMask(shape)
    if isinstance(spec, SlidingWindow):
        return masks.LocalMask(shape, window_size=(spec.size - 1, 0), offset=0)
    if isinstance(spec, LeadingKeys) and spec.inner == Causal():
        # Causal over the keys after the leading ones sees every leading key: a shifted diagonal.
        return masks.CausalMask(shape, offset=spec.num_leading)
    if isinstance(spec, (Union, Intersection)):
        parts = [splash_mask(part, q_len, kv_len) for part in spec.parts]
        if not all(isinstance(part, masks.NumpyMask) for part in parts):
            combine = operator.or_ if isinstance(spec, Union) else operator.and_
            return functools.reduce(combine, parts)
    return masks.NumpyMask(np.asarray(spec.dense(q_len, kv_len)))


def key_mask_as_segments(mask: jax.Array, segments: tuple[jax.Array, jax.Array] | None,
                         batch: int, q_len: int, kv_len: int) -> tuple[jax.Array, jax.Array]:
    """A key (padding) mask, broadcastable to [batch, 1, 1, kv_len], as segment ids: a masked
    key gets an id no query has, so the two forms hide exactly the same pairs.

    Args:
      mask: bool, True = may attend; its heads and query dims are 1.
      segments: None or (query ids int [batch, q_len], key ids int [batch, kv_len]).
    Returns:
      (query ids int32 [batch, q_len], key ids int32 [batch, kv_len]).
    """
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    keys = jnp.broadcast_to(mask[:, 0, 0, :], (batch, kv_len))
    if segments is None:
        query_ids = jnp.zeros((batch, q_len), jnp.int32)
        key_ids = jnp.zeros((batch, kv_len), jnp.int32)
    else:
        query_ids, key_ids = (ids.astype(jnp.int32) for ids in segments)
    nobody = jnp.min(query_ids) - 1  # below every query's id
    return query_ids, jnp.where(keys, key_ids, nobody)


def splash_block(length: int) -> int:
    """Splash's tile size along a sequence of `length` (a multiple of 128)."""
    return next(block for block in _BLOCK_CHOICES if length % block == 0)


def splash_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                     segment_ids: tuple[jax.Array, jax.Array] | None,
                     spec: SparsitySpec | None, scale: float, *, interpret: bool,
                     softcap: float | None = None) -> jax.Array:
    """Splash attention through its MQA entry point, one call per (example, key head).

    MHA, GQA and MQA are one path: each key head serves its group of
    num_heads // num_kv_heads query heads as an MQA kernel over that group.

    Args:
      query: [batch, q_len, num_heads, head_dim]; q_len and kv_len multiples of 128.
      key: [batch, kv_len, num_kv_heads, head_dim]; value: [batch, kv_len, num_kv_heads, value_dim].
      segment_ids: None or (query ids int [batch, q_len], key ids int [batch, kv_len]).
      spec: the static mask, or None.
      scale: score multiplier (splash does not scale; the query is multiplied once here).
      interpret: run the kernel with the Pallas interpreter (the only way on CPU).
      softcap: None, or a float > 0: splash's `attn_logits_soft_cap`, which caps the scaled
        scores s at softcap·tanh(s / softcap) before masking (the sink logit stays uncapped).
    Returns:
      [batch, q_len, num_heads, value_dim] in the input dtype; rows that see no key are zeros.
    """
    batch, q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[1:3]
    group = num_heads // num_kv_heads
    q_block, kv_block = splash_block(q_len), splash_block(kv_len)
    blocks = splash.BlockSizes(
        block_q=q_block, block_kv=kv_block, block_kv_compute=kv_block,
        block_q_dkv=q_block, block_kv_dkv=kv_block, block_kv_dkv_compute=kv_block,
        block_q_dq=q_block, block_kv_dq=kv_block,
    )
    mask = masks.MultiHeadMask([splash_mask(spec, q_len, kv_len)] * group)
    kernel = splash.make_splash_mqa_single_device(mask, block_sizes=blocks, interpret=interpret,
                                                  attn_logits_soft_cap=softcap)
    sinks = jnp.full((group,), _SINK_LOGIT, jnp.float32)

    def one_head(q, k, v, ids):  # q [group, q_len, head_dim], k/v [kv_len, dim]
        return kernel(q, k, v, segment_ids=ids, sinks=sinks)

    per_example = jax.vmap(one_head, in_axes=(0, 0, 0, None))  # over key heads
    grouped = (query * jnp.asarray(scale, query.dtype)).reshape(
        batch, q_len, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    if segment_ids is not None:
        segment_ids = splash.SegmentIds(*(ids.astype(jnp.int32) for ids in segment_ids))
    out = jax.vmap(per_example)(grouped, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3),
                                segment_ids)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, value.shape[-1])


# Lengths that splash tiles without padding: its kv blocks are multiples of 128 lanes.
PALLAS_LENGTH_MULTIPLE = 128


def call_segment_ids(call: Call) -> tuple[jax.Array, jax.Array] | None:
    """A call's segment ids for the kernels that take no mask (splash, context parallel): its
    ids, with a padding mask folded in (padded keys join no query's segment); None: neither."""
    ids = None if call.segments[0] is None else call.segments
    if call.mask is not None:
        (batch, q_len), kv_len = call.query.shape[:2], call.key.shape[1]
        ids = key_mask_as_segments(call.mask, ids, batch, q_len, kv_len)
    return ids


def _splash_lengths(platform, case):
    if case.q_len % PALLAS_LENGTH_MULTIPLE or case.kv_len % PALLAS_LENGTH_MULTIPLE:
        return (f"q_len and kv_len multiples of {PALLAS_LENGTH_MULTIPLE} "
                f"(got {case.q_len} and {case.kv_len})")


def _run(call: Call) -> jax.Array:
    return splash_attention(call.query, call.key, call.value, call_segment_ids(call), call.spec,
                            call.scale, interpret=call.interpret, softcap=call.softcap)


# Forced on "cpu", splash runs in Pallas interpret mode: slow, but the same code path, for tests.
KERNEL = Kernel(
    "splash", _run, platforms=("tpu",),
    needs=(on("tpu", "cpu"), dtype_in("float16", "bfloat16", "float32"),
           without("has_bias", "bias"), key_mask_only, _splash_lengths,
           without("has_sinks", "sinks")))
