"""The short causal convolution that linear-attention layers (Gated DeltaNet, Mamba) run over
their projected queries, keys and values before the token mixer: depthwise, a few taps wide,
each output reading the current token and the kernel_size - 1 before it.

Its state is those last kernel_size - 1 inputs, so a sequence processed in pieces (a first chunk,
then one token per decoding step) gives what the whole sequence gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfx.ops import _checks

__all__ = ["causal_conv1d"]


@jax.jit
def causal_conv1d(x: jax.Array, weight: jax.Array, *,
                  state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """y[t, c] = Σ_i weight[i, c] · x[t - (kernel_size - 1) + i, c], with the inputs before the
    sequence taken from `state` (zeros when None).

    Args:
      x: [batch, seq, channels].
      weight: [kernel_size, channels] (PyTorch's depthwise Conv1d weight [channels, 1,
        kernel_size], transposed).
      state: [batch, kernel_size - 1, channels], the inputs just before x, or None.
    Returns:
      (y [batch, seq, channels] in x's dtype, the next state [batch, kernel_size - 1,
      channels]: the last kernel_size - 1 inputs, the state included).
    """
    _checks.floating("x", x, ndim=3, layout="[batch, seq, channels]")
    _checks.floating("weight", weight, ndim=2, layout="[kernel_size, channels]")
    taps, channels = weight.shape
    batch, seq = x.shape[:2]
    if x.shape[2] != channels:
        raise ValueError(f"x has {x.shape[2]} channels, weight {weight.shape} has {channels}")
    state_shape = (batch, taps - 1, channels)
    if state is None:
        state = jnp.zeros(state_shape, x.dtype)
    elif state.shape != state_shape:
        raise ValueError(f"state must be [batch, kernel_size - 1, channels] = {state_shape}, "
                         f"got {state.shape}")
    padded = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    y = sum(padded[:, i:i + seq] * weight[i].astype(x.dtype) for i in range(taps))
    return y, padded[:, seq:]
