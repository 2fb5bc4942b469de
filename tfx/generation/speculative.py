"""`tfx.speculative_generate`: speculative decoding with a draft model, compiled once.

Each round, a small draft model proposes `num_draft_tokens` (k) tokens one at a time through its
own KV cache; the target model scores all k + 1 positions (the last accepted token and the k
proposals) in one cached call; the accepted prefix and one corrected or bonus token are
appended (`tfx.ops.speculative.verify_draft`), and both caches forget the rejected tokens
(`KVCache.rewind`). Linear-attention layers (hybrid models) cannot forget by position: their
caches keep the states before each of the last k tokens (`init_cache(..., rewind=k)`, at most
k tokens are forgotten per round) and rewind to the one at the accepted length. Greedy output
equals `tfx.generate(target, ...)` token for token; sampled output is distributed exactly as
the target's own samples (temperature, top-k and top-p applied to both models alike). The
target runs about max_new_tokens / (accepted + 1) times instead of max_new_tokens times, which
pays when the draft is much cheaper and often right.

Prefill, then one `lax.while_loop` of rounds, compiled once per (both models' structure, batch,
prompt-length bucket, max_new_tokens, k, which filters are on); sampling values are inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.generation._inputs import (
    decoder_prompt,
    integer,
    outside_jit,
    prompt_and_mask,
    sampling_filters,
    sampling_key,
    special_ids,
)
from tfx.generation._outputs import lengths
from tfx.generation.config import generation_config_of
from tfx.models.decoder import Decoder
from tfx.ops.kv_cache import KVCache
from tfx.ops.speculative import draw, token_probs, verify_draft

__all__ = ["SpeculativeStats", "speculative_generate"]


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """How a `speculative_generate` call went, per row (numpy int arrays [batch]).

    target_calls: target model calls the row took part in (the prefill included).
    drafted: draft tokens judged by the target.
    accepted: draft tokens accepted.
    new_tokens: tokens generated, up to and including EOS.
    """

    target_calls: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    new_tokens: np.ndarray

    @property
    def acceptance_rate(self) -> float:
        """Accepted / judged draft tokens, all rows together (0.0 when none was judged)."""
        return float(self.accepted.sum() / max(int(self.drafted.sum()), 1))

    @property
    def tokens_per_target_call(self) -> float:
        """New tokens per target call, all rows together (1.0 for plain decoding)."""
        return float(self.new_tokens.sum() / self.target_calls.sum())


def speculative_generate(target: Decoder, draft: Decoder, input_ids, *,
                         max_new_tokens: int | None = None, num_draft_tokens: int = 4,
                         temperature: float | None = None,
                         top_k: int | None = None, top_p: float | None = None,
                         rng: jax.Array | None = None, attention_mask=None,
                         eos_token_id: int | Sequence[int] | None = None,
                         pad_token_id: int | None = None, bucket: bool = True,
                         return_lengths: bool = False, return_stats: bool = False):
    """Continue prompts with `target`, drafting with `draft`.

    Arguments left None come from `target.generation_config`, as in `tfx.generate`; its
    logits processors (repetition_penalty, no_repeat_ngram_size) are not applied: speculative
    decoding has none, so a config that sets them decodes differently from `tfx.generate`.

    Args:
      target: the `tfx.models.Decoder` whose output is wanted.
      draft: a cheaper Decoder with the same vocabulary (e.g. `early_exit_draft(target, n)` or a
        smaller trained model).
      num_draft_tokens: k, tokens the draft proposes per round (int >= 1).
      input_ids: as in `tfx.generate`.
      max_new_tokens: as in `tfx.generate`.
      temperature: as in `tfx.generate`.
      top_k: as in `tfx.generate`.
      top_p: as in `tfx.generate`.
      rng: as in `tfx.generate`.
      attention_mask: as in `tfx.generate`.
      eos_token_id: as in `tfx.generate`.
      pad_token_id: as in `tfx.generate`.
      bucket: as in `tfx.generate`.
      return_lengths: as in `tfx.generate`.
      return_stats: also return a `SpeculativeStats` (last in the tuple).
    Returns:
      int32 [batch, prompt_len + max_new_tokens] as `tfx.generate`; with return_lengths and/or
      return_stats, a tuple `(tokens, lengths, stats)` of those asked for.
    Raises:
      TypeError: for models that are not Decoders, or when called under jax.jit / nnx.jit.
      ValueError: before anything compiles, for an argument out of range, different vocabulary
        sizes, a prompt + max_new_tokens longer than either model's max_len, or a model whose
        cache cannot forget rejected tokens (a ring-buffer sliding window shorter than the
        sequence, or a Transformer-XL memory).
    """
    _check_models(target, draft)
    outside_jit("tfx.speculative_generate", nnx.state(target), nnx.state(draft), input_ids,
                attention_mask, rng)
    defaults = generation_config_of(target)
    config = target.config
    ids, mask = prompt_and_mask(input_ids, attention_mask, config.vocab_size)
    max_new_tokens = integer("max_new_tokens", defaults.new_tokens(max_new_tokens, ids.shape[1]))
    num_draft = integer("num_draft_tokens", num_draft_tokens)
    filters = sampling_filters(*defaults.sampling(temperature, top_k, top_p))
    rng = sampling_key(rng, filters)
    eos, pad_token_id = special_ids(config, defaults, eos_token_id, pad_token_id)
    # The shorter of the two models' max_len bounds the prompt and new tokens.
    max_len = min(config.max_len, draft.config.max_len)
    padded_ids, padded_mask = decoder_prompt(max_len, ids, mask, max_new_tokens, bucket=bucket)
    cache_len = min(padded_ids.shape[1] + max_new_tokens, max_len)
    for name, model in (("target", target), ("draft", draft)):
        _check_rewindable(name, model, ids.shape[0], cache_len)
    (graphdef_t, state_t), (graphdef_d, state_d) = nnx.split(target), nnx.split(draft)
    tokens, counts = _speculate(
        (graphdef_t, graphdef_d), (state_t, state_d), jax.device_put(padded_ids.astype(np.int32)),
        jnp.asarray(padded_mask), rng, filters,
        jnp.asarray(eos or [-1], jnp.int32), jnp.int32(pad_token_id),
        max_new_tokens=max_new_tokens, num_draft=num_draft, cache_len=cache_len)
    tokens = np.asarray(tokens)  # assembled on the host, as tfx.generate does
    out = jax.device_put(np.concatenate([ids, tokens], axis=1).astype(np.int32))
    row_lengths = lengths(tokens, eos, ids.shape[1])
    extras = [jax.device_put(row_lengths)] if return_lengths else []
    if return_stats:
        rounds, drafted, accepted = (np.asarray(c) for c in counts)
        extras.append(SpeculativeStats(target_calls=rounds + 1, drafted=drafted,
                                       accepted=accepted,
                                       new_tokens=row_lengths - ids.shape[1]))
    return (out, *extras) if extras else out


def _check_models(target, draft) -> None:
    """Both Decoders, with one vocabulary."""
    for name, model in (("target", target), ("draft", draft)):
        if not isinstance(model, Decoder):
            raise TypeError(f"{name} must be a tfx Decoder, got {type(model).__name__}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"draft must share the target's vocabulary: draft vocab_size "
                         f"{draft.config.vocab_size}, target vocab_size "
                         f"{target.config.vocab_size}")


def _check_rewindable(name: str, model: Decoder, batch: int, cache_len: int) -> None:
    """The cache `model` would decode with must be able to forget rejected tokens (built
    abstractly: no memory, no compilation)."""
    cache = nnx.eval_shape(lambda: model.init_cache(batch, cache_len))
    if not isinstance(cache, KVCache):
        raise ValueError(f"{name} decodes with a {type(cache).__name__} (position="
                         f"{model.config.position!r}), which cannot forget rejected draft "
                         f"tokens: speculative decoding needs a KV cache")
    if cache.window is not None:
        raise ValueError(f"{name}'s cache is a ring buffer (sliding window {cache.window} < "
                         f"{cache_len} tokens), whose overwritten slots cannot be restored after "
                         f"rejected draft tokens: use a shorter prompt + max_new_tokens")


class _Round(NamedTuple):
    """The decoding loop's carry; arrays [batch] unless said.

    last: the newest emitted token, not yet in either cache.
    pending: the previous round's last draft token, which the draft's cache lacks after a round
      that accepted all k (the target's cache has it).
    tokens: int32 [batch, max_new_tokens]; count: tokens emitted so far.
    stats: target rounds, judged and accepted draft tokens, each int32 [batch].
    """

    i: jax.Array
    last: jax.Array
    pending: jax.Array
    caches: tuple[KVCache, KVCache]
    tokens: jax.Array
    count: jax.Array
    done: jax.Array
    stats: tuple[jax.Array, jax.Array, jax.Array]
    weights: tuple


@functools.partial(jax.jit, static_argnames=("graphdefs", "max_new_tokens", "num_draft",
                                             "cache_len"))
def _speculate(graphdefs, states, ids, mask, rng, filters, eos, pad_token_id, *,
               max_new_tokens: int, num_draft: int, cache_len: int):
    """The compiled program: prefill both models, draw the first token from the target, then a
    while loop of rounds. Returns int32 [batch, max_new_tokens] and the stats counters."""
    models = [nnx.merge(g, s) for g, s in zip(graphdefs, states, strict=True)]
    batch = ids.shape[0]
    caches, hidden = [], None
    for model in models:
        cache = model.init_cache(batch, cache_len, rewind=num_draft)
        out, cache = model.hidden_states(ids, attention_mask=mask, cache=cache)
        hidden = out if hidden is None else hidden  # the target's, to draw the first token
        caches.append(cache)
    heads = tuple(model.output_weights() for model in models)  # laid out once
    probs = token_probs(models[0].logits(hidden[:, -1], heads[0]), **filters)
    first = draw(_keys(rng, 1, salt=0)[0], probs)
    tokens = jnp.full((batch, max_new_tokens), pad_token_id, jnp.int32).at[:, 0].set(first)
    zeros = jnp.zeros((batch,), jnp.int32)
    carry = _Round(i=jnp.int32(1), last=first, pending=first, caches=tuple(caches),
                   tokens=tokens, count=zeros + 1,
                   done=jnp.isin(first, eos) | (max_new_tokens == 1), stats=(zeros,) * 3,
                   weights=(states, heads))
    advance = functools.partial(_advance, graphdefs=graphdefs, rng=rng, filters=filters,
                                eos=eos, pad_token_id=pad_token_id, num_draft=num_draft)
    # The weights ride in the carry (see tfx.generation.generate: NNX refuses values from an
    # outer trace inside nnx.scan of stacked layers).
    end = jax.lax.while_loop(lambda c: ~jnp.all(c.done), advance, carry)
    return end.tokens, end.stats


def _advance(carry: _Round, *, graphdefs, rng, filters, eos, pad_token_id,
             num_draft: int) -> _Round:
    """One round: draft k tokens, score them with the target in one call, keep the accepted
    prefix and one more token, rewind both caches past it."""
    (state_t, state_d), (head_t, head_d) = carry.weights
    target_cache, draft_cache = carry.caches
    remaining = jnp.where(carry.done, 0, carry.tokens.shape[1] - carry.count)
    draft_key, verify_key = _keys(rng, 2, salt=carry.i)
    drafts, draft_probs, draft_cache = _propose(
        graphdefs[1], state_d, head_d, draft_cache, carry, remaining,
        missing=draft_cache.next_position < target_cache.next_position, rng=draft_key,
        filters=filters, num_draft=num_draft)
    # The target sees the last token and the drafts; those past the row's budget are padding.
    chunk = jnp.concatenate([carry.last[:, None], drafts], axis=1)
    valid = jnp.arange(num_draft + 1)[None, :] < remaining[:, None]
    target = nnx.merge(graphdefs[0], state_t)
    start = target_cache.next_position
    hidden, target_cache = target.hidden_states(chunk, attention_mask=valid, cache=target_cache)
    target_probs = token_probs(target.logits(hidden, head_t), **filters)
    limit = jnp.minimum(num_draft, remaining)
    accepted, correction = verify_draft(target_probs, draft_probs, drafts, limit, verify_key)
    emitted = jnp.minimum(accepted + 1, remaining)
    run = jnp.where(jnp.arange(num_draft + 1)[None, :] < accepted[:, None],
                    jnp.pad(drafts, ((0, 0), (0, 1))), correction[:, None])
    tokens, done, last = _emit(carry, run, emitted, eos, pad_token_id)
    kept = start + emitted  # the caches keep the old last token and all emitted but the newest
    rounds, drafted, accepted_total = carry.stats
    return carry._replace(
        i=carry.i + 1, last=last, pending=drafts[:, -1],
        caches=(target_cache.rewind(kept), draft_cache.rewind(kept)), tokens=tokens,
        count=carry.count + emitted, done=done,
        stats=(rounds + (remaining > 0), drafted + limit, accepted_total + accepted))


def _propose(graphdef, state, head, cache: KVCache, carry: _Round, remaining, *, missing,
             rng, filters, num_draft: int):
    """The draft's k tokens, one call each: the first call feeds the pending token (where the
    cache lacks it) and the last token; later calls feed the previous draft. Feeds past a row's
    budget are padding. Returns drafts int32 [batch, k], their distributions float32
    [batch, k, vocab], and the draft cache."""
    draft = nnx.merge(graphdef, state)
    live = remaining > 0
    hidden, cache = draft.hidden_states(
        jnp.stack([carry.pending, carry.last], axis=1),
        attention_mask=jnp.stack([missing & live, live], axis=1), cache=cache)
    keys = _keys(rng, num_draft)
    probs = token_probs(draft.logits(hidden[:, -1], head), **filters)
    token = draw(keys[0], probs)
    batch, vocab = probs.shape
    drafts = jnp.zeros((batch, num_draft), jnp.int32).at[:, 0].set(token)
    all_probs = jnp.zeros((batch, num_draft, vocab), jnp.float32).at[:, 0].set(probs)

    def step(i, loop):
        state, cache, drafts, all_probs = loop
        draft = nnx.merge(graphdef, state)
        fed = (i < remaining)[:, None]  # the i-th draft is worth feeding only within budget
        previous = jax.lax.dynamic_slice_in_dim(drafts, i - 1, 1, axis=1)
        hidden, cache = draft.hidden_states(previous, attention_mask=fed, cache=cache)
        probs = token_probs(draft.logits(hidden[:, -1], head), **filters)
        token = draw(None if rng is None else keys[i], probs)
        return state, cache, drafts.at[:, i].set(token), all_probs.at[:, i].set(probs)

    _, cache, drafts, all_probs = jax.lax.fori_loop(
        1, num_draft, step, (state, cache, drafts, all_probs))
    return drafts, all_probs, cache


def _keys(rng: jax.Array | None, count: int, salt: jax.Array | int | None = None):
    """`count` independent keys from `rng` (first folded with `salt`, e.g. the round), or
    `count` Nones without one: greedy decoding draws argmaxes (`tfx.ops.speculative.draw`)."""
    if rng is None:
        return [None] * count
    return jax.random.split(rng if salt is None else jax.random.fold_in(rng, salt), count)


def _emit(carry: _Round, run, emitted, eos, pad_token_id):
    """Write the first `emitted` tokens of `run` (int32 [batch, k + 1]) after each row's
    tokens, padding what follows an EOS. Returns the tokens, done and the new last token."""
    width = run.shape[1]
    position = jnp.arange(width)[None, :]
    is_eos = jnp.isin(run, eos) & (position < emitted[:, None])
    after_eos = jnp.cumsum(is_eos, axis=1) - is_eos > 0
    run = jnp.where(after_eos, pad_token_id, run)
    max_new_tokens = carry.tokens.shape[1]
    columns = jnp.where(position < emitted[:, None], carry.count[:, None] + position,
                        max_new_tokens)  # out of range: dropped
    rows = jnp.arange(run.shape[0])[:, None]
    tokens = carry.tokens.at[rows, columns].set(run, mode="drop")
    newest = jnp.take_along_axis(run, jnp.maximum(emitted - 1, 0)[:, None], axis=1)[:, 0]
    last = jnp.where(emitted > 0, newest, carry.last)
    done = carry.done | is_eos.any(axis=1) | (carry.count + emitted >= max_new_tokens)
    return tokens, done, last
