"""GPU attention kernels: cuDNN's fused flash attention and the Pallas (Triton) flash kernel.

Both take tfx's layout ([batch, seq, heads, head_dim]) and run only the cases that
`tfx.ops.backends` lets through; this module maps tfx's arguments onto theirs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

from tfx.ops.sparse import Causal, Intersection, SlidingWindow, SparsitySpec

__all__ = ["cudnn_attention", "cudnn_mask", "pallas_gpu_attention"]


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
