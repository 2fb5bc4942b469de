"""GPU attention kernels: cuDNN's fused flash attention and the Pallas (Triton) flash kernel.

Both take tfx's layout ([batch, seq, heads, head_dim]) and run only the cases that
their records (`CUDNN`, `PALLAS_GPU`) let through; this module maps tfx's arguments onto theirs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

from tfx.ops.attention.kernel import (
    Call,
    Kernel,
    dtype_in,
    on,
    value_dim_is_head_dim,
    without,
    x64_disabled,
)
from tfx.ops.sparse import Causal, Intersection, SlidingWindow, SparsitySpec

__all__ = ["CUDNN", "CUDNN_MAX_HEAD_DIM", "PALLAS_GPU", "PALLAS_LENGTH_MULTIPLE",
           "cudnn_attention", "cudnn_mask", "pallas_gpu_attention"]


def cudnn_mask(spec: SparsitySpec | None) -> tuple[bool, int | None] | None:
    """`spec` as cuDNN's (is_causal, window) mask, or None when cuDNN has no equivalent.

    window is the number of keys a query sees, its own included (`SlidingWindow.size`); None is
    unlimited. An intersection of causal windows is the narrowest of them.
    """
    if spec is None:
        return False, None
    if spec == Causal():
        return True, None
    if isinstance(spec, SlidingWindow):
        return True, spec.size
    if isinstance(spec, Intersection):
        parts = [cudnn_mask(part) for part in spec.parts]
        if all(part is not None and part[0] for part in parts):
            windows = [window for _, window in parts if window is not None]
            return True, min(windows, default=None)
    return None


def cudnn_attention(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
                    spec: SparsitySpec | None, scale: float) -> jax.Array:
    """`jax.nn.dot_product_attention(implementation="cudnn")` on a case cuDNN supports.

    Args:
      query: [batch, q_len, num_heads, head_dim], float16 or bfloat16.
      key: [batch, kv_len, num_kv_heads, head_dim]; cuDNN reads GQA heads in place.
      value: [batch, kv_len, num_kv_heads, head_dim].
      bias: None or broadcastable to [batch, num_heads, q_len, kv_len]; cuDNN adds it in the
        input dtype.
      spec: None, causal or a causal sliding window (see `cudnn_mask`).
    Returns:
      [batch, q_len, num_heads, head_dim] in the input dtype.
    """
    is_causal, window = cudnn_mask(spec)
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape).astype(query.dtype)
    return jax.nn.dot_product_attention(
        query, key, value, bias=bias, scale=scale, is_causal=is_causal,
        # jax counts the keys left of the query, the query excluded; tfx counts it.
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )


def pallas_gpu_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                         segment_ids: jax.Array | None, spec: SparsitySpec | None, scale: float,
                         *, interpret: bool) -> jax.Array:
    """The Pallas GPU flash kernel (`jax.experimental.pallas.ops.gpu.attention.mha`).

    The kernel wants as many key heads as query heads, so GQA/MQA keys and values are repeated
    (a [batch, kv_len, num_heads, head_dim] copy; cuDNN, preferred when it applies, avoids it).

    Args:
      query: [batch, seq, num_heads, head_dim]; key, value: [batch, seq, num_kv_heads, head_dim]
        (self-attention lengths: one sequence length, a multiple of the kernel's blocks).
      segment_ids: None or int [batch, seq], shared by queries and keys.
      spec: None or `Causal()`.
      interpret: run the kernel with the Pallas interpreter (the only way on CPU).
    Returns:
      [batch, seq, num_heads, head_dim] in the input dtype.
    """
    group = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    return pallas_gpu.mha(query, key, value, segment_ids, sm_scale=scale,
                          causal=spec == Causal(), interpret=interpret)


# cuDNN's flash attention takes head_dim <= 128 before Hopper and <= 256 from Hopper on; the
# platform name does not say which GPU this is, so selection keeps the limit every GPU meets.
CUDNN_MAX_HEAD_DIM = 128
# The Pallas kernel's 128-row forward and 32-row backward blocks divide these lengths (padding
# keys would need a key mask, which the kernel cannot take).
PALLAS_LENGTH_MULTIPLE = 128


def _cudnn_head_dim(platform, case):
    if case.head_dim > CUDNN_MAX_HEAD_DIM or case.head_dim % 8:
        return f"head_dim <= {CUDNN_MAX_HEAD_DIM} and a multiple of 8 (got {case.head_dim})"


def _pallas_gpu_head_dim(platform, case):
    # Triton's dot needs at least 16 on each side; 256 bounds the shared memory of one tile.
    if not 16 <= case.head_dim <= 256 or case.head_dim % 16:
        return f"head_dim in [16, 256] and a multiple of 16 (got {case.head_dim})"


def _cudnn_spec(platform, case):
    if cudnn_mask(case.spec) is None:
        return f"a causal or sliding-window static mask, or none (got {case.spec})"
    if case.spec is not None and case.q_len != case.kv_len:
        # cuDNN aligns its causal mask bottom-right when q_len != kv_len, tfx top-left.
        return f"q_len == kv_len with a static mask (got {case.q_len} and {case.kv_len})"


def _cudnn_bias_lengths(platform, case):
    if case.has_bias and (case.q_len % 2 or case.kv_len % 2):
        return f"even q_len and kv_len with a bias (got {case.q_len} and {case.kv_len})"


def _causal_or_none(platform, case):
    if case.spec is not None and case.spec != Causal():
        return f"is_causal or no static mask, no other sparsity (got {case.spec})"


def _self_attention_lengths(platform, case):
    # The fused backward pass cuts queries and keys into the same number of blocks.
    if case.q_len != case.kv_len or case.q_len % PALLAS_LENGTH_MULTIPLE:
        return (f"q_len == kv_len, a multiple of {PALLAS_LENGTH_MULTIPLE} "
                f"(got {case.q_len} and {case.kv_len})")


def _run_cudnn(call: Call) -> jax.Array:
    return cudnn_attention(call.query, call.key, call.value, call.bias, call.spec, call.scale)


def _run_pallas_gpu(call: Call) -> jax.Array:
    return pallas_gpu_attention(call.query, call.key, call.value, call.segments[0], call.spec,
                                call.scale, interpret=call.interpret)


# jax exposes no logit soft-capping for cuDNN's fused attention nor for the Pallas GPU kernel.
CUDNN = Kernel(
    "cudnn", _run_cudnn, platforms=("gpu",),
    needs=(on("gpu"), dtype_in("float16", "bfloat16"), _cudnn_head_dim, value_dim_is_head_dim,
           without("has_mask", "mask"), without("has_segments", "segment ids"), _cudnn_spec,
           _cudnn_bias_lengths, without("has_softcap", "softcap"),
           without("has_sinks", "sinks")))
# Forced on "cpu", the Pallas kernel runs in interpret mode: slow, but the same code path.
PALLAS_GPU = Kernel(
    "pallas_gpu", _run_pallas_gpu, platforms=("gpu",),
    needs=(on("gpu", "cpu"), dtype_in("float16", "bfloat16", "float32"), _pallas_gpu_head_dim,
           value_dim_is_head_dim, without("has_bias", "bias"), without("has_mask", "mask"),
           without("cross_segments", "key_segment_ids apart from query_segment_ids"),
           _causal_or_none, _self_attention_lengths, x64_disabled,
           without("has_softcap", "softcap"), without("has_sinks", "sinks")))
