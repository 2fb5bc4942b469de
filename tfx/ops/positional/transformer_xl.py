"""Transformer-XL relative attention scores (Dai et al., 2019)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tfx.ops import _checks as checks
from tfx.ops.positional.absolute import sinusoidal

__all__ = [
    "transformer_xl_position_embeddings",
    "transformer_xl_position_scores",
    "transformer_xl_scores",
]


@functools.partial(jax.jit, static_argnames=("kv_len", "dim"))
def transformer_xl_position_embeddings(kv_len: int, dim: int) -> jax.Array:
    """Sinusoidal embeddings R of the relative distances kv_len-1, ..., 1, 0 (descending).

    Row r encodes distance kv_len-1-r with [sin | cos] halves, as the original code does; project
    it with W_R to get the `position_keys` of `transformer_xl_scores`.

    Args:
      kv_len: number of keys (memory plus current segment), >= 1.
      dim: even embedding width (d_model), >= 2.
    Returns:
      float32 `[kv_len, dim]`.
    """
    kv_len = checks.positive_int("kv_len", kv_len)
    return sinusoidal(jnp.arange(kv_len - 1, -1, -1), dim, layout="concat")


def _check_scores_inputs(query, key, position_keys, u, v) -> None:
    checks.floating("query", query, ndim=4, layout="[batch, q_len, heads, head_dim]")
    checks.floating("key", key, ndim=4, layout="[batch, kv_len, heads, head_dim]")
    checks.floating("position_keys", position_keys, ndim=3, layout="[kv_len, heads, head_dim]")
    checks.floating("u", u, ndim=2, layout="[heads, head_dim]")
    checks.floating("v", v, ndim=2, layout="[heads, head_dim]")
    batch, q_len, heads, head_dim = query.shape
    kv_len = key.shape[1]
    if key.shape != (batch, kv_len, heads, head_dim):
        raise ValueError(
            f"key of shape {tuple(key.shape)} must be [batch, kv_len, heads, head_dim] with "
            f"batch, heads, head_dim = {(batch, heads, head_dim)} as in query"
        )
    if kv_len < q_len:
        raise ValueError(
            f"key length ({kv_len}) must be >= query length ({q_len}): the queries are the last "
            "q_len of the kv_len positions"
        )
    if position_keys.shape != (kv_len, heads, head_dim):
        raise ValueError(
            f"position_keys of shape {tuple(position_keys.shape)} must be [kv_len, heads, "
            f"head_dim] = {(kv_len, heads, head_dim)}"
        )
    for name, bias in (("u", u), ("v", v)):
        if bias.shape != (heads, head_dim):
            raise ValueError(
                f"{name} of shape {tuple(bias.shape)} must be [heads, head_dim] = "
                f"{(heads, head_dim)}"
            )


def _rel_shift(by_distance: jax.Array) -> jax.Array:
    """Re-index `[..., q_len, kv_len]` from (i, column r = distance kv_len-1-r) to (i, key j).

    Row i must move left by q_len-1-i. Padding a zero column and reading the buffer back with
    rows one longer does exactly that in O(q_len·kv_len), with no gather; entries for keys after
    the causal diagonal pick up values of the next row (garbage, masked by the caller).
    """
    *lead, q_len, kv_len = by_distance.shape
    padded = jnp.pad(by_distance, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])
    shifted = padded.reshape(*lead, kv_len + 1, q_len)[..., 1:, :]
    return shifted.reshape(*lead, q_len, kv_len)


@jax.jit
def transformer_xl_scores(
    query: jax.Array, key: jax.Array, position_keys: jax.Array, u: jax.Array, v: jax.Array
) -> jax.Array:
    """Unscaled Transformer-XL attention logits (q + u)·k_j + (q + v)·W_R R_{i-j}.

    The q_len queries are the last q_len of the kv_len key positions (the first kv_len - q_len
    keys are the memory), so query i sits at absolute position i + kv_len - q_len. The position
    term is computed per distance and re-indexed per key with the rel-shift trick, never
    materialising a [q_len, kv_len, head_dim] tensor of relative embeddings.

    Entries for keys after the query (j > i + kv_len - q_len, negative distance) are unspecified:
    apply a causal mask with query offset kv_len - q_len (True where j <= i + kv_len - q_len).

    Args:
      query: float `[batch, q_len, heads, head_dim]`.
      key: float `[batch, kv_len, heads, head_dim]`, kv_len >= q_len (memory then segment).
      position_keys: float `[kv_len, heads, head_dim]`, W_R·R with row r holding distance
        kv_len-1-r (e.g. `transformer_xl_position_embeddings(kv_len, d_model) @ W_R`, reshaped).
      u: float `[heads, head_dim]`, the content bias.
      v: float `[heads, head_dim]`, the position bias.
    Returns:
      float32 `[batch, heads, q_len, kv_len]`, not divided by sqrt(head_dim).
    """
    _check_scores_inputs(query, key, position_keys, u, v)
    content = jnp.einsum("bthd,bshd->bhts", query + u, key, preferred_element_type=jnp.float32)
    return content + transformer_xl_position_scores(query, position_keys, v)


@jax.jit
def transformer_xl_position_scores(
    query: jax.Array, position_keys: jax.Array, v: jax.Array
) -> jax.Array:
    """The position term (q + v)·W_R R_{i-j} of `transformer_xl_scores` alone.

    Models add it to the scores as a bias and put the content bias u into the queries, so the
    content term goes through the ordinary attention kernel. Same conventions as
    `transformer_xl_scores` (queries are the last q_len of kv_len positions; entries for future
    keys are unspecified and must be masked).

    Args:
      query: float `[batch, q_len, heads, head_dim]`.
      position_keys: float `[kv_len, heads, head_dim]`, kv_len >= q_len, row r = distance
        kv_len-1-r.
      v: float `[heads, head_dim]`.
    Returns:
      float32 `[batch, heads, q_len, kv_len]`, unscaled.
    """
    checks.floating("query", query, ndim=4, layout="[batch, q_len, heads, head_dim]")
    checks.floating("position_keys", position_keys, ndim=3, layout="[kv_len, heads, head_dim]")
    checks.floating("v", v, ndim=2, layout="[heads, head_dim]")
    _, q_len, heads, head_dim = query.shape
    if position_keys.shape[1:] != (heads, head_dim) or position_keys.shape[0] < q_len:
        raise ValueError(
            f"position_keys of shape {tuple(position_keys.shape)} must be [kv_len >= {q_len}, "
            f"{heads}, {head_dim}]"
        )
    if v.shape != (heads, head_dim):
        raise ValueError(f"v of shape {tuple(v.shape)} must be [heads, head_dim] = "
                         f"{(heads, head_dim)}")
    by_distance = jnp.einsum(
        "bthd,shd->bhts", query + v, position_keys, preferred_element_type=jnp.float32
    )
    return _rel_shift(by_distance)
