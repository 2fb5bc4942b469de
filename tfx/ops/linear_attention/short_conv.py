"""The short causal convolution that linear-attention layers (Gated DeltaNet, Mamba) run over
their projected queries, keys and values before the token mixer: depthwise, a few taps wide,
each output reading the current token and the kernel_size - 1 before it.

Its state is those last kernel_size - 1 inputs, so a sequence processed in pieces (a first chunk,
then one token per decoding step) gives what the whole sequence gives. Padding (`token_mask`
False) is skipped, as attention skips a masked key: each real token reads the real inputs
before it, and the state holds the last kernel_size - 1 real inputs, wherever padding sits
(left-padded prompts, a right-padded chunk of a prefill, a row that feeds nothing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tfx.ops import _checks

__all__ = ["causal_conv1d"]


@functools.partial(jax.jit, static_argnames=("history",))
def causal_conv1d(x: jax.Array, weight: jax.Array, *, state: jax.Array | None = None,
                  token_mask: jax.Array | None = None, history: int = 0):
    """y[t, c] = Σ_i weight[i, c] · u[t - (kernel_size - 1) + i, c], where u is the sequence of
    real inputs (the `state`, zeros when None, then the tokens that `token_mask` keeps) and t
    a real token's index in it.

    Args:
      x: [batch, seq, channels].
      weight: [kernel_size, channels] (PyTorch's depthwise Conv1d weight [channels, 1,
        kernel_size], transposed).
      state: [batch, kernel_size - 1, channels], the real inputs just before x, or None.
      token_mask: bool [batch, seq], False for padding (skipped: it moves no input into the
        state, and its output is zero), or None when every token is real.
      history: also return the state before each of the last `history` tokens (int >= 0).
    Returns:
      (y [batch, seq, channels] in x's dtype, the next state [batch, kernel_size - 1,
      channels]: the last kernel_size - 1 real inputs, the state included), and with a
      history the states before each of the last min(history, seq) tokens [batch,
      min(history, seq), kernel_size - 1, channels].
    """
    _checks.floating("x", x, ndim=3, layout="[batch, seq, channels]")
    _checks.floating("weight", weight, ndim=2, layout="[kernel_size, channels]")
    _checks.positive_int("history", history, minimum=0)
    taps, channels = weight.shape
    batch, seq = x.shape[:2]
    if x.shape[2] != channels:
        raise ValueError(f"x has {x.shape[2]} channels, weight {weight.shape} has {channels}")
    lag = taps - 1
    state_shape = (batch, lag, channels)
    if state is None:
        state = jnp.zeros(state_shape, x.dtype)
    elif state.shape != state_shape:
        raise ValueError(f"state must be [batch, kernel_size - 1, channels] = {state_shape}, "
                         f"got {state.shape}")
    padded = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    rows = jnp.arange(batch)[:, None]
    if token_mask is None:
        real, inputs = jnp.ones((batch, lag + seq), bool), padded
    else:
        _checks.boolean("token_mask", token_mask)
        if token_mask.shape != (batch, seq):
            raise ValueError(f"token_mask must be [batch, seq] = {(batch, seq)}, got "
                             f"{token_mask.shape}")
        real = jnp.concatenate([jnp.ones((batch, lag), bool), token_mask.astype(bool)], axis=1)
    # Real inputs seen so far, at each place of [state | x]: the real input there is the
    # (count - 1)-th of u, the sequence without padding.
    counts = jnp.cumsum(real, axis=1, dtype=jnp.int32)
    if token_mask is not None:  # u, packed to the front (the tail beyond the count: zeros)
        inputs = jnp.zeros_like(padded).at[rows, jnp.where(real, counts - 1, lag + seq)].set(
            padded, mode="drop")
    # y over u: the output of u's j-th input for j >= lag.
    y = sum(inputs[:, i:i + seq] * weight[i].astype(x.dtype) for i in range(taps))
    if token_mask is not None:  # each real token's output is that of its place in u
        y = jnp.take_along_axis(y, jnp.maximum(counts[:, lag:] - 1 - lag, 0)[..., None], axis=1)
        y = jnp.where(token_mask[..., None], y, jnp.zeros((), y.dtype))

    def window(ends):  # the lag inputs of u before each end, int [batch, n] -> [batch, n, lag, c]
        return inputs[rows[..., None], ends[..., None] - lag + jnp.arange(lag)]

    next_state = window(counts[:, -1:])[:, 0]
    if not history:
        return y, next_state
    before = counts[:, lag:] - real[:, lag:]  # real inputs before each token of x
    return y, next_state, window(before[:, seq - min(history, seq):])
