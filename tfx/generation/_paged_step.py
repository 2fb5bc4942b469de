"""The compiled step of `tfx.generation.Engine`: one model call over a paged cache for every
running sequence (a chunk of prompt, or one decoded token), and the next token of each row."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.ops.paged import PagedCache
from tfx.ops.sampling import sample_logits

__all__ = ["compile_step", "paged_step"]


def compile_step(graphdef) -> Callable:
    """`paged_step` for one model structure, jitted: `(state, cache, ids, valid, temperature,
    keys, counts) -> (tokens, cache)`. The graphdef is closed over rather than passed as a
    static argument, which jit would hash at every call (~1.6 ms a step for char-gpt). The
    cache is donated: each step updates the pools in place instead of copying them."""
    return jax.jit(functools.partial(paged_step, graphdef), donate_argnames=("cache",))


def paged_step(graphdef, state, cache: PagedCache, ids: jax.Array, valid: jax.Array,
               temperature: jax.Array, keys: jax.Array,
               counts: jax.Array) -> tuple[jax.Array, PagedCache]:
    """Feed each row its tokens and choose its next token.

    Args:
      graphdef, state: `nnx.split` of the decoder.
      cache: the PagedCache, its page table covering every fed token.
      ids: int32 [batch, width], each row's tokens left-aligned (padding anywhere after).
      valid: bool [batch, width], which are real; a row may feed none.
      temperature: float32 [batch], 0 for greedy rows.
      keys: uint32 [batch, 2], each request's raw jax.random key (any value for greedy rows).
      counts: int32 [batch], tokens each request generated so far: folded into its key, so a
        request's samples do not depend on which others share its steps.
    Returns:
      int32 [batch] tokens chosen from the logits after each row's last fed token (meaningless
      for rows that fed none), and the updated cache.
    """
    model = nnx.merge(graphdef, state)
    hidden, cache = model.hidden_states(ids, attention_mask=valid, cache=cache)
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
    hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
    logits = model.logits(hidden)[:, 0]

    def choose(row_logits, key, count, row_temperature):
        key = jax.random.fold_in(jax.random.wrap_key_data(key), count)
        return sample_logits(row_logits[None], key, temperature=row_temperature)[0]

    return jax.vmap(choose)(logits, keys, counts, temperature), cache
