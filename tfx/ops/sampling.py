"""Choosing the next token from logits: greedy, temperature, top-k and nucleus (top-p) sampling.

The filters follow Hugging Face's logits warpers in their order (temperature, then top-k, then
top-p) and conventions: top-k keeps every token tied with the k-th largest logit; top-p keeps
the smallest set of most likely tokens whose probability reaches `top_p` (the most likely token
always stays).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfx.ops import _checks

__all__ = ["filter_logits", "sample_logits"]


def _check_logits(logits) -> None:
    _checks.floating("logits", logits, ndim=2, layout="[batch, vocab]")
    if logits.shape[1] < 1:  # batch may be 0 (an empty result); a choice needs a token
        raise ValueError(f"logits must have vocab >= 1 tokens, got shape {tuple(logits.shape)}")


@jax.jit
def filter_logits(logits: jax.Array, *, top_k: jax.Array | None = None,
                  top_p: jax.Array | None = None) -> jax.Array:
    """Set the logits of tokens outside the top-k / nucleus to -inf.

    Args:
      logits: float [batch, vocab] (already divided by the temperature).
      top_k: int scalar >= 1, or None for no top-k filter. Values above vocab keep everything.
      top_p: float scalar in (0, 1], or None for no nucleus filter.
    Returns:
      float32 [batch, vocab].
    """
    _check_logits(logits)
    logits = logits.astype(jnp.float32)
    if top_k is None and top_p is None:
        return logits
    ordered = -jnp.sort(-logits, axis=-1)  # descending
    threshold = jnp.full(logits.shape[:1], -jnp.inf)
    if top_k is not None:
        kth = jnp.clip(top_k, 1, logits.shape[-1]) - 1
        threshold = ordered[:, kth]
        ordered = jnp.where(ordered >= threshold[:, None], ordered, -jnp.inf)
    if top_p is not None:
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        kept = jnp.sum(before < top_p, axis=-1)  # >= 1: the first token has before = 0
        threshold = jnp.maximum(threshold, jnp.take_along_axis(ordered, kept[:, None] - 1,
                                                               axis=-1)[:, 0])
    return jnp.where(logits >= threshold[:, None], logits, -jnp.inf)


@jax.jit
def sample_logits(logits: jax.Array, rng: jax.Array | None, *, temperature: jax.Array,
                  top_k: jax.Array | None = None, top_p: jax.Array | None = None) -> jax.Array:
    """Next tokens from logits.

    Args:
      logits: float [batch, vocab].
      rng: a jax.random key (unused, and may be None, when the temperature is a Python 0.0).
      temperature: float scalar >= 0; 0 is greedy (argmax), ignoring top_k / top_p.
      top_k: see `filter_logits`; None switches the filter off.
      top_p: see `filter_logits`; None switches the filter off.
    Returns:
      int32 [batch].
    """
    _check_logits(logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if rng is None:
        return greedy
    temperature = jnp.asarray(temperature, jnp.float32)
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    sampled = jax.random.categorical(rng, filter_logits(scaled, top_k=top_k, top_p=top_p))
    return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)
