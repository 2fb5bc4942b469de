"""The compiled step of `tfx.generation.Engine`: one model call over a paged cache for every
running sequence (a chunk of prompt, or one decoded token), and the next token of each row.

A hybrid model's linear-attention layers keep one fixed-size state per engine row
(`DeltaState` [max_batch, ...]) beside the attention layers' pages: a step whose rows are a
packed subset of the engine's (the prefill rows) takes each row's states by `state_rows`, and
puts them back after the call."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn.variants import row_variants
from tfx.ops.linear_attention import DeltaState
from tfx.ops.paged import PagedCache
from tfx.ops.sampling import filter_logits

__all__ = ["RowSettings", "compile_step", "paged_step"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
    """How each row of a step chooses its token, and which weights it runs with.

    temperature: float32 [batch], 0 for greedy rows.
    top_k: int32 [batch], the vocabulary size for rows without a top-k filter.
    top_p: float32 [batch], 1 for rows without a nucleus filter.
    keys: uint32 [batch, 2], each request's raw jax.random key (any value for greedy rows).
    counts: int32 [batch], tokens each request generated so far: folded into its key, so a
      request's samples do not depend on which others share its steps.
    variants: int32 [batch], the weight variant of each row (`tfx.nn.row_variants`: e.g. its
      LoRA adapter, 0 = the base weights); unused by a model without variants.
    state_rows: int32 [batch], the row of the cache's recurrent states (linear-attention
      layers) that each row continues (out of range: a row that feeds nothing), or None: row
      i continues row i. Unused by a model without linear layers.
    fresh: bool [batch], rows that start a new sequence from empty states (a request just
      admitted), or None for none.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array
    counts: jax.Array
    variants: jax.Array
    state_rows: jax.Array | None = None
    fresh: jax.Array | None = None


def compile_step(graphdef) -> Callable:
    """`paged_step` for one model structure, jitted: `(state, cache, ids, valid, rows) ->
    (tokens, logprobs, cache)`. The graphdef is closed over rather than passed as a static
    argument, which jit would hash at every call (~1.6 ms a step for char-gpt). The cache is
    donated: each step updates the pools in place instead of copying them."""
    return jax.jit(functools.partial(paged_step, graphdef), donate_argnames=("cache",))


def paged_step(graphdef, state, cache: PagedCache, ids: jax.Array, valid: jax.Array,
               rows: RowSettings) -> tuple[jax.Array, jax.Array, PagedCache]:
    """Feed each row its tokens and choose its next token.

    Args:
      graphdef, state: `nnx.split` of the decoder.
      cache: the PagedCache, its page table covering every fed token.
      ids: int32 [batch, width], each row's tokens left-aligned (padding anywhere after).
      valid: bool [batch, width], which are real; a row may feed none.
      rows: each row's sampling settings and weight variant.
    Returns:
      int32 [batch] tokens chosen from the logits after each row's last fed token (meaningless
      for rows that fed none), float32 [batch] their log-probabilities under the model's
      distribution (before temperature and filters), and the updated cache.
    """
    model = nnx.merge(graphdef, state)
    kept = cache.layers
    with row_variants(rows.variants):
        hidden, cache = model.hidden_states(ids, attention_mask=valid,
                                            cache=_row_states(cache, rows))
        last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
        hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
        logits = model.logits(hidden)[:, 0].astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # an all-greedy step skips the sampling, and a step without filters their sorts
    tokens = jax.lax.cond(jnp.any(rows.temperature > 0), _sample, lambda *_: greedy, logits,
                          rows)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, None], axis=1)[:, 0]
    return tokens, logprobs, _put_row_states(cache, kept, rows)


def _row_states(cache: PagedCache, rows: RowSettings) -> PagedCache:
    """The cache with each linear layer's states taken for the step's rows (`state_rows`),
    empty for the `fresh` ones."""
    if (rows.state_rows is None and rows.fresh is None) or not isinstance(cache.layers, tuple):
        return cache

    def take(layer):
        if not isinstance(layer, DeltaState):
            return layer
        if rows.state_rows is not None:  # out-of-range rows feed nothing: any state serves
            layer = jax.tree.map(lambda x: jnp.take(x, rows.state_rows, axis=0, mode="clip"),
                                 layer)
        if rows.fresh is not None:
            layer = jax.tree.map(
                lambda x: jnp.where(rows.fresh.reshape(-1, *[1] * (x.ndim - 1)), 0, x), layer)
        return layer

    return dataclasses.replace(cache, layers=tuple(map(take, cache.layers)))


def _put_row_states(cache: PagedCache, kept: tuple, rows: RowSettings) -> PagedCache:
    """The step's cache with each linear layer's states written back to their rows of `kept`
    (the layers before the step): a step over a subset of the rows leaves the others as
    they were."""
    if rows.state_rows is None or not isinstance(cache.layers, tuple):
        return cache

    def put(old, new):
        if not isinstance(new, DeltaState):
            return new
        return jax.tree.map(lambda o, n: o.at[rows.state_rows].set(n, mode="drop"), old, new)

    return dataclasses.replace(cache, layers=tuple(map(put, kept, cache.layers)))


def _sample(logits: jax.Array, rows: RowSettings) -> jax.Array:
    """Each row's token from float32 [batch, vocab] logits: argmax for greedy rows, else a
    draw from softmax(logits / temperature) within the row's top-k and nucleus."""
    scaled = logits / jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    # top_p = 1 must keep every token: the cumulative sum may round below 1 before the last
    # one, so "off" is passed as 2 (never reached)
    top_p = jnp.where(rows.top_p < 1.0, rows.top_p, 2.0)
    filtered = jax.lax.cond(
        jnp.any(rows.top_k < logits.shape[-1]) | jnp.any(top_p < 1.0),
        lambda: jax.vmap(lambda row, k, p: filter_logits(row[None], top_k=k, top_p=p)[0])(
            scaled, rows.top_k, top_p),
        lambda: scaled)

    def draw(row, key, count):
        key = jax.random.fold_in(jax.random.wrap_key_data(key), count)
        return jax.random.categorical(key, row).astype(jnp.int32)

    sampled = jax.vmap(draw)(filtered, rows.keys, rows.counts)
    return jnp.where(rows.temperature > 0, sampled, jnp.argmax(logits, -1).astype(jnp.int32))
