"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; the linear attention of Qwen3-Next
and Qwen3.5): a recurrent state S [key_dim, value_dim] per head, updated token by token as

    S ← exp(g_t) · S                       (gated decay, g_t ≤ 0)
    δ_t = β_t · (v_t − Sᵀ k_t)             (the delta rule: correct what S recalls for k_t)
    S ← S + k_t δ_tᵀ
    o_t = Sᵀ (scale · q_t)

Two forms compute it. `gated_delta_rule` is the chunked form for training and prefill: within a
chunk of C tokens the corrections δ solve one unit lower-triangular system (the WY form of
DeltaNet, Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule"), and a scan
carries S from chunk to chunk, so the work is O(N·C·d + N·d²) and the memory O(N·C) instead of
the O(N·d²) states of the token loop. `gated_delta_recurrent` is the token loop itself, for the
few tokens of a decoding step. Both return the state after the last token, which a cache keeps.

Layout as `tfx.ops.dot_product_attention`'s: query, key [batch, seq, key_heads, key_dim], value
[batch, seq, heads, value_dim], with `heads` a multiple of `key_heads` (value head h reads key
head h // (heads // key_heads), as Qwen3-Next repeats them); log_decay and beta [batch, seq,
heads]; the state [batch, heads, key_dim, value_dim]. The maths is float32 for every input dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tfx.ops import _checks

__all__ = ["gated_delta_recurrent", "gated_delta_rule"]


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size"))
def gated_delta_rule(query: jax.Array, key: jax.Array, value: jax.Array, log_decay: jax.Array,
                     beta: jax.Array, *, initial_state: jax.Array | None = None,
                     scale: float | None = None,
                     chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a sequence, chunk by chunk.

    Args:
      query: [batch, seq, key_heads, key_dim].
      key: [batch, seq, key_heads, key_dim] (Qwen3-Next L2-normalises queries and keys first).
      value: [batch, seq, heads, value_dim]; key_heads divides heads.
      log_decay: [batch, seq, heads], g_t ≤ 0 (the state decays by exp(g_t)).
      beta: [batch, seq, heads], the delta rule's step size, in [0, 1].
      initial_state: [batch, heads, key_dim, value_dim] float32, or None for zeros.
      scale: query multiplier; default 1/sqrt(key_dim).
      chunk_size: tokens per chunk (the sequence is padded to a multiple of it).
    Returns:
      (output [batch, seq, heads, value_dim] in value's dtype, final state [batch, heads,
      key_dim, value_dim] float32).
    """
    q, k, v, g, b, state, scale = _prepared(query, key, value, log_decay, beta, initial_state,
                                            scale)
    _checks.positive_int("chunk_size", chunk_size)
    seq = q.shape[2]
    pad = -seq % chunk_size
    # Padding tokens have k = v = 0, β = 0 and no decay: they leave the state as it is.
    q, k, v, g, b = (jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
                     for x in (q, k, v, g, b))
    chunks = (q.shape[2]) // chunk_size
    q, k, v = (x.reshape(*x.shape[:2], chunks, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, b = (x.reshape(*x.shape[:2], chunks, chunk_size) for x in (g, b))
    out, state = _chunked(q * scale, k, v, g, b, state)
    out = out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :seq]
    return out.transpose(0, 2, 1, 3).astype(value.dtype), state


def _chunked(q, k, v, g, beta, state):
    """q, k [B, H, N, C, Dk], v [B, H, N, C, Dv], g and beta [B, H, N, C], state [B, H, Dk,
    Dv] -> (output [B, H, N, C, Dv], final state)."""
    size = q.shape[3]
    decay = jnp.cumsum(g, axis=-1)  # G_i: the log decay from the chunk's start to token i
    causal = jnp.tril(jnp.ones((size, size), bool))
    # exp(G_i - G_j) for j <= i; masked before exp, where it could overflow.
    gaps = jnp.exp(jnp.where(causal, decay[..., :, None] - decay[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    # δ = U - W·S0 solves (I + L)·δ = β·v - β·exp(G)·k·S0, L_ij = β_i k_i·k_j exp(G_i - G_j)
    # for j < i: the corrections of the tokens before i within the chunk.
    lower = jnp.einsum("bhnid,bhnjd->bhnij", k_beta, k) * gaps * ~jnp.eye(size, dtype=bool)
    eye = jnp.broadcast_to(jnp.eye(size, dtype=q.dtype), lower.shape)
    inverse = jax.lax.linalg.triangular_solve(lower + eye, eye, left_side=True, lower=True,
                                              unit_diagonal=True)
    u = inverse @ (v * beta[..., None])
    w = inverse @ (k_beta * jnp.exp(decay)[..., None])
    scores = jnp.einsum("bhnid,bhnjd->bhnij", q, k) * gaps

    def chunk(state, xs):
        q, k, u, w, decay, scores = xs
        delta = u - w @ state
        out = (q * jnp.exp(decay)[..., None]) @ state + scores @ delta
        last = decay[..., -1:]
        state = state * jnp.exp(last)[..., None] + jnp.swapaxes(
            k * jnp.exp(last - decay)[..., None], -1, -2) @ delta
        return state, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, u, w, decay, scores))
    state, out = jax.lax.scan(chunk, state, xs)
    return jnp.moveaxis(out, 0, 2), state


@functools.partial(jax.jit, static_argnames=("scale", "states"))
def gated_delta_recurrent(query: jax.Array, key: jax.Array, value: jax.Array,
                          log_decay: jax.Array, beta: jax.Array, *,
                          initial_state: jax.Array | None = None,
                          scale: float | None = None, states: bool = False):
    """The gated delta rule token by token (a decoding step's few tokens over a cached state).
    Arguments and result as `gated_delta_rule`'s; with `states`, also the state after each
    token, float32 [batch, seq, heads, key_dim, value_dim] (what a cache that may forget the
    last tokens keeps: `tfx.ops.linear_attention.DeltaHistory`)."""
    q, k, v, g, b, state, scale = _prepared(query, key, value, log_decay, beta, initial_state,
                                            scale)

    def token(state, xs):
        q, k, v, g, b = xs  # [B, H, D] and [B, H]
        state = state * jnp.exp(g)[..., None, None]
        delta = (v - jnp.einsum("bhk,bhkv->bhv", k, state)) * b[..., None]
        state = state + k[..., :, None] * delta[..., None, :]
        out = jnp.einsum("bhk,bhkv->bhv", q * scale, state)
        return state, (out, state) if states else out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, b))
    state, out = jax.lax.scan(token, state, xs)
    if states:
        out, after = out
        return (jnp.moveaxis(out, 0, 1).astype(value.dtype), state,
                jnp.moveaxis(after, 0, 1))
    return jnp.moveaxis(out, 0, 1).astype(value.dtype), state


def _prepared(query, key, value, log_decay, beta, state, scale):
    """Checked inputs, heads-major float32 ([B, H, T, D] and [B, H, T]), key heads repeated to
    the value heads, the state (zeros when None) and the scale."""
    layout = "[batch, seq, heads, dim]"
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.floating(name, x, ndim=4, layout=layout)
    for name, x in (("log_decay", log_decay), ("beta", beta)):
        _checks.floating(name, x, ndim=3, layout="[batch, seq, heads]")
    batch, seq, heads, value_dim = value.shape
    key_heads, key_dim = query.shape[2:]
    if key.shape != query.shape or query.shape[:2] != (batch, seq) or heads % key_heads:
        raise ValueError(f"query {query.shape} and key {key.shape} must be equal [batch, seq, "
                         f"key_heads, key_dim] with key_heads dividing the heads of value "
                         f"{value.shape}")
    for name, x in (("log_decay", log_decay), ("beta", beta)):
        if x.shape != (batch, seq, heads):
            raise ValueError(f"{name} must be [batch, seq, heads] = {(batch, seq, heads)}, got "
                             f"{x.shape}")
    state_shape = (batch, heads, key_dim, value_dim)
    if state is None:
        state = jnp.zeros(state_shape, jnp.float32)
    elif state.shape != state_shape:
        raise ValueError(f"initial_state must be [batch, heads, key_dim, value_dim] = "
                         f"{state_shape}, got {state.shape}")
    scale = key_dim ** -0.5 if scale is None else _checks.positive_float("scale", scale)
    q, k = (jnp.repeat(x, heads // key_heads, axis=2) for x in (query, key))
    q, k, v = (x.astype(jnp.float32).transpose(0, 2, 1, 3) for x in (q, k, value))
    g, b = (x.astype(jnp.float32).transpose(0, 2, 1) for x in (log_decay, beta))
    return q, k, v, g, b, state.astype(jnp.float32), scale
