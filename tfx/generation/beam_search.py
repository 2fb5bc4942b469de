"""`tfx.beam_search`: beam search for encoder–decoders (T5), compiled once.

The source is encoded once and its cross-attention keys/values cached once, then expanded to
batch * num_beams rows; each step decodes one token for every beam, keeps the best candidates
and reorders the cache rows (`Seq2SeqCache.take`) to follow the surviving beams. The loop is one
`lax.while_loop`, compiled once per (model structure, batch, source length, num_beams,
max_new_tokens, number of EOS ids); length_penalty, early_stopping and the token ids are inputs.

Semantics are those of Hugging Face transformers' `_beam_search` (v5), step by step:
- every beam's log-softmax is added to its running score, and the best
  `max(2, 1 + num_eos) * num_beams` (beam, token) candidates over all beams are kept, so that at
  least `num_beams` of them do not end in EOS;
- the best `num_beams` candidates that do not end (EOS, or the last step) run on;
- among the first `num_beams` candidates, those that end become finished hypotheses scored
  `sum of log-probs / length ** length_penalty`, where length counts the generated tokens
  including the EOS but not the decoder start token; each batch row keeps its best `num_beams`;
- a row stops accepting hypotheses when its `num_beams` slots are full and either
  early_stopping is True, or the best running score divided by (current generated length) **
  length_penalty (early_stopping False; with "never" and length_penalty > 0 by max_new_tokens **
  length_penalty) cannot beat its worst finished score. The loop ends when every row has stopped
  or after max_new_tokens steps.
Differences from transformers: ties between exactly equal scores may be broken differently;
the output is always 1 + max_new_tokens long (transformers crops it to the longest returned
sequence); no logits processors (min_length, repetition penalties...); and a vocabulary smaller
than the candidates kept per step is refused (transformers would run duplicate beams).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.generation._inputs import integer, pad_id, prompt_and_mask, real, source_fits, token_ids
from tfx.generation._outputs import lengths
from tfx.models.encoder_decoder import EncoderDecoder

__all__ = ["beam_search"]

EARLY_STOPPING = {False: 0, True: 1, "never": 2}


def beam_search(model: EncoderDecoder, input_ids, *, num_beams: int, max_new_tokens: int,
                length_penalty: float = 1.0, early_stopping: bool | str = False,
                attention_mask=None, eos_token_id: int | Sequence[int] | None = None,
                pad_token_id: int | None = None, num_return_sequences: int = 1,
                return_scores: bool = False, return_lengths: bool = False):
    """Beam search from an encoder–decoder, like transformers' `generate(num_beams=...)`.

    Args:
      model: a `tfx.models.EncoderDecoder` (T5).
      input_ids: int [batch, src_len] (an array or nested lists), the sources: ids in
        [0, vocab_size), batch and src_len >= 1, src_len within a learned position table.
      num_beams: beams per source, >= 1.
      max_new_tokens: tokens to generate after the decoder start token, >= 1.
      length_penalty: finite exponent of the length that divides a finished hypothesis' summed
        log-probability (> 0 favours longer sequences, 0 compares raw sums).
      early_stopping: False (transformers' default heuristic), True (stop a source as soon as
        it has num_beams finished hypotheses) or "never" (see the module docstring).
      attention_mask: [batch, src_len], 1 for real tokens and 0 for padding.
      eos_token_id: token id(s) that finish a hypothesis, or None (hypotheses end at
        max_new_tokens).
      pad_token_id: filler after EOS; default: the config's `embeddings.pad_id`, else the first
        eos_token_id, else 0 (as `tfx.generate`).
      num_return_sequences: best hypotheses returned per source, 1 <= n <= num_beams.
      return_scores: also return the hypotheses' length-penalised scores.
      return_lengths: also return each hypothesis' length.
    Returns:
      int32 [batch * num_return_sequences, 1 + max_new_tokens]: the decoder start token, then
      the tokens, best hypothesis first within each source; then, in this order, with
      return_scores float32 [batch * num_return_sequences] scores (transformers'
      `sequences_scores`), with return_lengths int32 [batch * num_return_sequences] lengths:
      1 (the start token) + the tokens up to and including the first EOS (all max_new_tokens
      without one).
    Raises:
      ValueError: before anything compiles, for an argument out of range (numbers may be
        Python or numpy scalars; NaN and infinities are refused).
    """
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"beam_search needs an encoder-decoder model (tfx EncoderDecoder), got "
                        f"{type(model).__name__}; decoder-only beam search is not implemented")
    config = model.config
    ids, mask = prompt_and_mask(input_ids, attention_mask, config.vocab_size)
    source_fits(config, ids.shape[1])
    num_beams = integer("num_beams", num_beams)
    max_new_tokens = integer("max_new_tokens", max_new_tokens)
    num_return_sequences = integer("num_return_sequences", num_return_sequences)
    if num_return_sequences > num_beams:
        raise ValueError(f"num_return_sequences ({num_return_sequences}) must be <= num_beams "
                         f"({num_beams})")
    length_penalty = real("length_penalty", length_penalty)
    if not (isinstance(early_stopping, bool | np.bool_) or early_stopping == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    eos = token_ids("eos_token_id", eos_token_id, config.vocab_size)
    pad_token_id = pad_id(config, pad_token_id, eos)
    candidates = max(2, 1 + len(eos)) * num_beams
    if candidates > config.vocab_size:
        raise ValueError(f"num_beams ({num_beams}) is too large for the vocabulary: each step "
                         f"keeps {candidates} candidates, more than vocab_size "
                         f"({config.vocab_size})")
    if config.position == "learned" and max_new_tokens > config.max_len:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) exceeds the model's max_len "
                         f"({config.max_len})")
    graphdef, state = nnx.split(model)
    tokens, scores = _beam_search(
        graphdef, state, jax.device_put(ids.astype(np.int32)), jnp.asarray(mask),
        jnp.asarray(eos or [-1], jnp.int32), jnp.int32(pad_token_id),
        jnp.float32(length_penalty), jnp.int32(EARLY_STOPPING[early_stopping]),
        num_beams=num_beams, max_new_tokens=max_new_tokens)
    # Assembled on the host, as in `generate`, so that no glue op compiles per shape.
    tokens = np.asarray(tokens)[:, :num_return_sequences].reshape(-1, max_new_tokens)
    start = np.full((tokens.shape[0], 1), config.decoder_start_token_id)
    out = [jax.device_put(np.concatenate([start, tokens], axis=1).astype(np.int32))]
    if return_scores:
        out.append(jax.device_put(np.asarray(scores)[:, :num_return_sequences].reshape(-1)))
    if return_lengths:
        out.append(jax.device_put(lengths(tokens, eos, 1)))
    return tuple(out) if len(out) > 1 else out[0]


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [batch, n, ...] at index [batch, m] along axis 1 -> [batch, m, ...]."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _join_finished(hypotheses: tuple, candidates: jax.Array, penalised: jax.Array,
                   take: jax.Array) -> tuple:
    """The best `beams` of the finished hypotheses (tokens [batch, beams, steps], scores and
    flags [batch, beams]) and of the candidates `take` marks (tokens [batch, keep, steps],
    length-penalised scores [batch, keep])."""
    finished, finished_scores, is_finished = hypotheses
    merged = jnp.concatenate([finished_scores, jnp.where(take, penalised, -jnp.inf)], axis=1)
    finished_scores, best = jax.lax.top_k(merged, finished_scores.shape[1])
    return (_gather(jnp.concatenate([finished, candidates], axis=1), best), finished_scores,
            _gather(jnp.concatenate([is_finished, take], axis=1), best))


def _settled(best_running: jax.Array, finished_scores: jax.Array,
             is_finished: jax.Array) -> jax.Array:
    """bool [batch]: rows whose finished hypotheses no running beam can beat any more
    (transformers' heuristic: the best running score [batch], penalised at the current or
    the maximal length, is no better than the worst finished one)."""
    return jnp.all(is_finished, axis=1) & (best_running <= finished_scores.min(axis=1))


@functools.partial(jax.jit, static_argnames=("graphdef", "num_beams", "max_new_tokens"))
def _beam_search(graphdef, state, ids, mask, eos, pad_token_id, length_penalty, early_stopping,
                 *, num_beams: int, max_new_tokens: int):
    """The compiled program. Returns the finished hypotheses, best first: int32 tokens
    [batch, num_beams, max_new_tokens] and float32 scores [batch, num_beams]."""
    batch, beams, steps = ids.shape[0], num_beams, max_new_tokens
    keep = max(2, 1 + eos.shape[0]) * beams
    never = (early_stopping == EARLY_STOPPING["never"]) & (length_penalty > 0)
    stop_when_full = early_stopping == EARLY_STOPPING[True]

    def unfinished(carry):
        i, *_, is_finished, open_rows = carry
        return (i < steps) & jnp.any(open_rows) & ~(stop_when_full & jnp.all(is_finished))

    def advance(carry):
        i, weights, last, cache, running, running_scores, finished, finished_scores, \
            is_finished, open_rows = carry
        # Weights ride in the carry: NNX refuses outer-trace values under a nested trace.
        logits, cache = nnx.merge(graphdef, weights).decode(last[:, None], cache=cache)
        log_probs = jax.nn.log_softmax(logits[:, -1].astype(jnp.float32), axis=-1)
        vocab = log_probs.shape[-1]
        log_probs = log_probs.reshape(batch, beams, vocab) + running_scores[:, :, None]
        scores, index = jax.lax.top_k(log_probs.reshape(batch, beams * vocab), keep)
        source, token = index // vocab, index % vocab  # [batch, keep]
        candidates = _gather(running, source).at[:, :, i].set(token)
        ends = jnp.isin(token, eos) | (i + 1 >= steps)

        # The best candidates that go on become the running beams; the cache follows them.
        running_scores, chosen = jax.lax.top_k(jnp.where(ends, -jnp.inf, scores), beams)
        running = _gather(candidates, chosen)
        cache = cache.take((jnp.arange(batch)[:, None] * beams + _gather(source, chosen))
                           .reshape(-1))

        # Ending candidates among the first `beams` join the finished hypotheses of open rows.
        take = ends & (jnp.arange(keep) < beams) & (
            open_rows & ~(jnp.all(is_finished, axis=1) & stop_when_full))[:, None]
        finished, finished_scores, is_finished = _join_finished(
            (finished, finished_scores, is_finished), candidates,
            scores / (i + 1).astype(jnp.float32) ** length_penalty, take)
        length = jnp.where(never, steps, i + 1).astype(jnp.float32)
        open_rows = open_rows & ~_settled(running_scores[:, 0] / length**length_penalty,
                                          finished_scores, is_finished)
        return (i + 1, weights, running[:, :, i].reshape(-1), cache, running, running_scores,
                finished, finished_scores, is_finished, open_rows)

    start = _start(nnx.merge(graphdef, state), ids, mask, pad_token_id, beams, steps)
    carry = jax.lax.while_loop(unfinished, advance, (jnp.int32(0), state, *start))
    return carry[6], carry[7]


def _start(model, ids, mask, pad_token_id, beams: int, steps: int) -> tuple:
    """The loop's state before the first step: (last tokens [batch * beams], the cache, running
    [batch, beams, steps] and their scores, finished ones and theirs, is_finished, open_rows)."""
    batch = ids.shape[0]
    cache = model.init_cache(model.encode(ids, attention_mask=mask), steps, attention_mask=mask)
    cache = cache.take(jnp.repeat(jnp.arange(batch), beams))  # row b * beams + k: beam k of b
    last = jnp.full((batch * beams,), model.config.decoder_start_token_id, jnp.int32)
    running = jnp.full((batch, beams, steps), pad_token_id, jnp.int32)
    # Only the first beam is live at first, so that the beams do not all pick the same tokens.
    running_scores = jnp.zeros((batch, beams)).at[:, 1:].set(-1e9)
    finished_scores = jnp.full((batch, beams), -jnp.inf)
    is_finished = jnp.zeros((batch, beams), bool)
    open_rows = jnp.ones((batch,), bool)  # rows whose finished hypotheses may still improve
    return (last, cache, running, running_scores, running, finished_scores, is_finished,
            open_rows)
