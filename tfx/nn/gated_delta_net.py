"""Gated DeltaNet (Yang et al. 2024), the linear-attention layer of Qwen3-Next and Qwen3.5, as a
Flax NNX module with `Attention`'s place in a block.

A call: project queries and keys (key_heads × key_dim), values and an output gate (heads ×
value_dim), the step sizes β and the decay rates; run the short causal convolution over
[queries | keys | values] (SiLU after it); L2-normalise queries and keys; mix tokens with the
gated delta rule (`tfx.ops.linear_attention`); RMS-normalise each head's output and multiply it
by SiLU(gate); project back. Its memory is a `DeltaState`: the convolution's last inputs and the
delta rule's state, a fixed size however long the sequence is (`tfx.ops.linear_attention.
DeltaState`, with the states before the last tokens when a cache must be able to forget them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn import axes
from tfx.nn.linear import flat_linear
from tfx.ops.linear_attention import (
    DeltaState,
    causal_conv1d,
    empty_state,
    gated_delta_recurrent,
    gated_delta_rule,
    record,
)
from tfx.ops.norms import rms_norm

__all__ = ["DeltaState", "GatedDeltaNet"]


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet token mixing.

    Args:
      d_model: width of the input and output.
      heads: value heads (each with its own delta-rule state).
      key_heads: query and key heads, dividing heads (value head h reads key head
        h // (heads // key_heads)).
      key_dim: features per query and key head.
      value_dim: features per value head.
      kernel_size: taps of the short causal convolution.
      norm_eps: epsilon of the per-head output RMSNorm and its gate.
      chunk_size: tokens per chunk of the chunked delta rule.
      dtype: compute dtype.
      param_dtype: storage dtype of the parameters.
    """

    def __init__(self, d_model: int, *, heads: int, key_heads: int, key_dim: int,
                 value_dim: int, kernel_size: int = 4, norm_eps: float = 1e-6,
                 chunk_size: int = 64, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if key_heads < 1 or heads % key_heads:
            raise ValueError(f"key_heads ({key_heads}) must be >= 1 and divide heads ({heads})")
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.heads, self.key_heads = heads, key_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.norm_eps, self.chunk_size, self.dtype = norm_eps, chunk_size, dtype

        def linear(width, axes_out=axes.HEADS, axes_in=axes.EMBED, features_in=d_model):
            return flat_linear(features_in, width, use_bias=False, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs,
                               kernel_metadata=axes.metadata(axes_in, axes_out))

        self.query = linear(key_heads * key_dim)
        self.key = linear(key_heads * key_dim)
        self.value = linear(heads * value_dim)
        self.gate = linear(heads * value_dim)
        self.beta = linear(heads)
        self.decay = linear(heads)
        self.out = linear(d_model, axes.EMBED, axes.HEADS, heads * value_dim)
        channels = 2 * key_heads * key_dim + heads * value_dim
        self.conv = nnx.Param(jax.random.normal(rngs.params(), (kernel_size, channels),
                                                param_dtype) / kernel_size ** 0.5)
        # Decay rate exp(a_log) · softplus(x·W + dt_bias), as Mamba 2 discretises it.
        self.a_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (heads,), param_dtype,
                                                          1.0, 16.0)))
        self.dt_bias = nnx.Param(jnp.ones((heads,), param_dtype))
        self.norm_scale = nnx.Param(jnp.ones((value_dim,), param_dtype))

    def __call__(self, x: jax.Array, state: DeltaState | None = None, *,
                 token_mask: jax.Array | None = None):
        """[batch, seq, d_model] -> [batch, seq, d_model]; with a `state` (the layer's memory
        of earlier tokens), also the next state.

        token_mask: bool [batch, seq], False for padding, which is skipped: read as zeros (as
          Hugging Face's layer reads them), it moves nothing into the convolution's state and
          neither decays nor writes the delta rule's state, so a padded call leaves the state
          that the real tokens alone leave.
        """
        batch, seq, _ = x.shape
        keep = None if token_mask is None else token_mask.astype(bool)
        if keep is not None:
            x = jnp.where(keep[..., None], x, jnp.zeros((), x.dtype))
        history = None if state is None else state.history
        last = 0 if history is None else min(history.size, seq)  # tokens whose states it keeps
        mixed = jnp.concatenate([self.query(x), self.key(x), self.value(x)], axis=-1)
        mixed, conv_state, *conv_before = causal_conv1d(
            mixed, self.conv[...].astype(mixed.dtype),
            state=None if state is None else state.conv, token_mask=keep, history=last)
        mixed = jax.nn.silu(mixed)
        width = self.key_heads * self.key_dim
        query, key, value = jnp.split(mixed, [width, 2 * width], axis=-1)
        query, key = (_unit(t.reshape(batch, seq, self.key_heads, self.key_dim))
                      for t in (query, key))
        value = value.reshape(batch, seq, self.heads, self.value_dim)
        beta = jax.nn.sigmoid(self.beta(x).astype(jnp.float32))
        log_decay = -jnp.exp(self.a_log[...]) * jax.nn.softplus(
            self.decay(x).astype(jnp.float32) + self.dt_bias[...])
        if keep is not None:  # padding neither decays nor writes the state
            beta, log_decay = (jnp.where(keep[..., None], t, 0.0) for t in (beta, log_decay))
        initial = None if state is None else state.delta
        rule = (query, key, value, log_decay, beta)
        if last:  # the last tokens one by one, keeping the state before each
            out, delta, history = self._with_history(rule, initial, history, conv_before[0],
                                                     keep, last)
        elif state is not None and seq == 1:  # a decoding step: the token loop is the cheapest
            out, delta = gated_delta_recurrent(*rule, initial_state=initial)
        else:
            out, delta = gated_delta_rule(*rule, initial_state=initial,
                                          chunk_size=self.chunk_size)
        gate = self.gate(x).reshape(batch, seq, self.heads, self.value_dim)
        out = rms_norm(out, self.norm_scale[...], epsilon=self.norm_eps) * jax.nn.silu(
            gate.astype(jnp.float32)).astype(out.dtype)
        out = self.out(out.reshape(batch, seq, self.heads * self.value_dim))
        return out if state is None else (out, DeltaState(conv_state, delta, history))

    def _with_history(self, rule, initial, history, conv_before, keep, last: int):
        """The delta rule over a call whose state keeps a history: chunked over all but the
        `last` tokens, then token by token, recording the states before each of those.
        Returns (output, final delta state, the updated DeltaHistory)."""
        seq = rule[0].shape[1]
        head = [t[:, :seq - last] for t in rule]
        outs = []
        if seq > last:
            out, initial = gated_delta_rule(*head, initial_state=initial,
                                            chunk_size=self.chunk_size)
            outs.append(out)
        out, delta, after = gated_delta_recurrent(*(t[:, seq - last:] for t in rule),
                                                  initial_state=initial, states=True)
        before = jnp.concatenate([initial[:, None], after[:, :-1]], axis=1)
        keep = jnp.ones(rule[0].shape[:2], bool) if keep is None else keep
        history = record(history, conv_before, before, keep[:, seq - last:],
                         jnp.sum(keep[:, :seq - last], axis=1, dtype=jnp.int32))
        return jnp.concatenate([*outs, out], axis=1), delta, history

    def empty_state(self, batch: int, dtype=jnp.float32, history: int = 0) -> DeltaState:
        """The memory before the first token: zeros; with `history` > 0 it also keeps the
        states before each of its last `history` tokens, so that a cache can forget up to
        that many (`tfx.ops.linear_attention.rewind_state`)."""
        return empty_state(batch, kernel_size=self.conv.shape[0], channels=self.conv.shape[1],
                           heads=self.heads, key_dim=self.key_dim, value_dim=self.value_dim,
                           dtype=dtype, history=history)


def _unit(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(Σx² + eps) over the last axis (Qwen3-Next's L2 norm of queries and keys)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
