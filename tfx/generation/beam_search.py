"""`tfx.beam_search`: beam search for decoders (GPT-2, LLaMA...) and encoder–decoders (T5),
compiled once.

One loop serves both kinds; they differ only in how it starts (`tfx.generation._steps.prefill`):
a decoder reads its prompts once (left-aligned, as `tfx.generate` lays them out), an
encoder–decoder encodes its sources once, caches their cross-attention keys/values and decodes
the start token. The cache is then expanded to batch * num_beams rows; each step decodes one
token for every beam, keeps the best candidates and reorders the cache rows (`KVCache.take`,
`Seq2SeqCache.take`) to follow the surviving beams. The loop is one `lax.while_loop`, compiled
once per (model structure, batch, prompt-length bucket or source length, num_beams,
max_new_tokens, number of EOS ids, which logits processors are on); length_penalty,
early_stopping, the processors' values and the token ids are inputs.

Semantics are those of Hugging Face transformers' `_beam_search` (v5), step by step:
- every beam's log-softmax goes through the logits processors (repetition penalty, no-repeat
  n-grams, bad words, min_new_tokens, in transformers' order; see
  `tfx.generation.processors`), is added to its running score, and the best
  `max(2, 1 + num_eos) * num_beams` (beam, token) candidates over all beams are kept, so that at
  least `num_beams` of them do not end in EOS;
- the best `num_beams` candidates that do not end (EOS, or the last step) run on;
- among the first `num_beams` candidates, those that end become finished hypotheses scored
  `sum of log-probs / length ** length_penalty`, where length counts the generated tokens
  including the EOS but neither the prompt nor the decoder start token (transformers' `cur_len
  + 1 - decoder_prompt_len`); each batch row keeps its best `num_beams`;
- a row stops accepting hypotheses when its `num_beams` slots are full and either
  early_stopping is True, or the best running score divided by (current generated length) **
  length_penalty (early_stopping False; with "never" and length_penalty > 0 by max_new_tokens **
  length_penalty) cannot beat its worst finished score. The loop ends when every row has stopped
  or after max_new_tokens steps.
Differences from transformers: ties between exactly equal scores may be broken differently;
the output always has all max_new_tokens columns (transformers crops it to the longest returned
sequence); stop sequences are `tfx.generate`'s only; and a vocabulary smaller than the
candidates kept per step is refused (transformers would run duplicate beams).
"""

from __future__ import annotations

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
    real,
    source_fits,
    special_ids,
)
from tfx.generation._outputs import lengths
from tfx.generation._steps import prefill, step
from tfx.generation.config import generation_config_of
from tfx.generation.generate import NO_PROCESSORS
from tfx.generation.processors import LogitsProcessors, logits_processors
from tfx.models.decoder import Decoder
from tfx.models.encoder_decoder import EncoderDecoder

__all__ = ["beam_search"]

EARLY_STOPPING = {False: 0, True: 1, "never": 2}


def beam_search(model: Decoder | EncoderDecoder, input_ids, *, num_beams: int,
                max_new_tokens: int | None = None, length_penalty: float | None = None,
                early_stopping: bool | str | None = None, attention_mask=None,
                eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                num_return_sequences: int = 1, return_scores: bool = False,
                return_lengths: bool = False, repetition_penalty: float | None = None,
                no_repeat_ngram_size: int | None = None, min_new_tokens: int | None = None,
                bad_words_ids: Sequence[Sequence[int]] | None = None):
    """Beam search, like transformers' `generate(num_beams=...)`.

    Arguments left None (but num_beams) come from `model.generation_config`, as in
    `tfx.generate`: max_new_tokens, length_penalty (default 1.0), early_stopping (default
    False), eos_token_id, pad_token_id, repetition_penalty and no_repeat_ngram_size.

    Args:
      model: a `tfx.models.Decoder` (GPT-2, LLaMA...) or `EncoderDecoder` (T5).
      input_ids: int [batch, length] (an array or nested lists), ids in [0, vocab_size), batch
        and length >= 1: a decoder's prompts (padded on either side) or an encoder–decoder's
        sources (length within a learned position table).
      num_beams: beams per input, >= 1.
      max_new_tokens: tokens to generate, >= 1 (a decoder's prompt + max_new_tokens must fit
        its max_len).
      length_penalty: finite exponent of the length that divides a finished hypothesis' summed
        log-probability (> 0 favours longer sequences, 0 compares raw sums).
      early_stopping: False (transformers' default heuristic), True (stop an input as soon as
        it has num_beams finished hypotheses) or "never" (see the module docstring).
      attention_mask: [batch, length], 1 for real tokens and 0 for padding.
      eos_token_id: token id(s) that finish a hypothesis; [] for none (hypotheses end at
        max_new_tokens).
      pad_token_id: filler after EOS; default as in `tfx.generate`: the generation config's,
        else the model config's `embeddings.pad_id`, else the first eos_token_id, else 0.
      num_return_sequences: best hypotheses returned per input, 1 <= n <= num_beams.
      return_scores: also return the hypotheses' length-penalised scores.
      return_lengths: also return each hypothesis' length.
      repetition_penalty: a logits processor, as in `tfx.generate`, applied to every beam's
        log-probabilities.
      no_repeat_ngram_size: a logits processor, as repetition_penalty.
      min_new_tokens: a logits processor, as repetition_penalty.
      bad_words_ids: a logits processor, as repetition_penalty.
    Returns:
      int32 [batch * num_return_sequences, head + max_new_tokens], best hypothesis first within
      each input: head columns (a decoder's prompt as given, padding included; an
      encoder–decoder's start token), then the new tokens; then, in this order, with
      return_scores float32 [batch * num_return_sequences] scores (transformers'
      `sequences_scores`), with return_lengths int32 [batch * num_return_sequences] lengths:
      head + the tokens up to and including the first EOS (all max_new_tokens without one).
    Raises:
      ValueError: before anything compiles, for an argument out of range (numbers may be
        Python or numpy scalars; NaN and infinities are refused).
      TypeError: for a model of another kind, or when called under jax.jit / nnx.jit.
    """
    if not isinstance(model, Decoder | EncoderDecoder):
        raise TypeError(f"model must be a tfx Decoder or EncoderDecoder, got "
                        f"{type(model).__name__}")
    outside_jit("tfx.beam_search", nnx.state(model), input_ids, attention_mask)
    defaults = generation_config_of(model)
    config = model.config
    ids, mask = prompt_and_mask(input_ids, attention_mask, config.vocab_size)
    seq2seq = isinstance(model, EncoderDecoder)
    max_new_tokens = integer("max_new_tokens", defaults.new_tokens(
        max_new_tokens, 1 if seq2seq else ids.shape[1]))
    eos, pad_token_id = special_ids(config, defaults, eos_token_id, pad_token_id)
    unset = defaults.fill(length_penalty=length_penalty, early_stopping=early_stopping,
                          repetition_penalty=repetition_penalty,
                          no_repeat_ngram_size=no_repeat_ngram_size)
    search = _check_search(config.vocab_size, len(eos), num_beams, num_return_sequences,
                           unset["length_penalty"], unset["early_stopping"])
    processors = logits_processors(
        config.vocab_size, eos, repetition_penalty=unset["repetition_penalty"],
        no_repeat_ngram_size=unset["no_repeat_ngram_size"], min_new_tokens=min_new_tokens,
        bad_words_ids=bad_words_ids)
    if seq2seq:
        source_fits(config, ids.shape[1])
        if config.position == "learned" and max_new_tokens > config.max_len:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) exceeds the model's max_len "
                             f"({config.max_len})")
        head = np.full((ids.shape[0], 1), config.decoder_start_token_id)
        inputs = ids, mask
    else:
        head, inputs = ids, decoder_prompt(config.max_len, ids, mask, max_new_tokens, bucket=True)
    tokens, scores = _beam_search(
        *nnx.split(model), jax.device_put(inputs[0].astype(np.int32)), jnp.asarray(inputs[1]),
        jnp.asarray(eos or [-1], jnp.int32), jnp.int32(pad_token_id),
        search["length_penalty"], search["early_stopping"], processors,
        num_beams=search["num_beams"], max_new_tokens=max_new_tokens)
    # Assembled on the host, as in `generate`, so that no glue op compiles per shape.
    returned = search["num_return_sequences"]
    tokens = np.asarray(tokens)[:, :returned].reshape(-1, max_new_tokens)
    head = np.repeat(head, returned, axis=0)
    out = [jax.device_put(np.concatenate([head, tokens], axis=1).astype(np.int32))]
    if return_scores:
        out.append(jax.device_put(np.asarray(scores)[:, :returned].reshape(-1)))
    if return_lengths:
        out.append(jax.device_put(lengths(tokens, eos, head.shape[1])))
    return tuple(out) if len(out) > 1 else out[0]


def _check_search(vocab_size: int, num_eos: int, num_beams, num_return_sequences,
                  length_penalty, early_stopping) -> dict:
    """Validate the search's own arguments; returns them as ints and traced scalars."""
    num_beams = integer("num_beams", num_beams)
    num_return_sequences = integer("num_return_sequences", num_return_sequences)
    if num_return_sequences > num_beams:
        raise ValueError(f"num_return_sequences ({num_return_sequences}) must be <= num_beams "
                         f"({num_beams})")
    length_penalty = real("length_penalty", length_penalty)
    if not (isinstance(early_stopping, bool | np.bool_) or early_stopping == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    candidates = max(2, 1 + num_eos) * num_beams
    if candidates > vocab_size:
        raise ValueError(f"num_beams ({num_beams}) is too large for the vocabulary: each step "
                         f"keeps {candidates} candidates, more than vocab_size "
                         f"({vocab_size})")
    return {"num_beams": num_beams, "num_return_sequences": num_return_sequences,
            "length_penalty": jnp.float32(length_penalty),
            "early_stopping": jnp.int32(EARLY_STOPPING[early_stopping])}


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


class _Beams(NamedTuple):
    """The search's state between steps, per batch row: the running beams (int32 tokens
    [batch, beams, steps], float32 summed log-probabilities [batch, beams]), the finished
    hypotheses (tokens, length-penalised scores, which slots hold one), and open_rows
    (bool [batch], rows whose finished hypotheses may still improve)."""

    running: jax.Array
    running_scores: jax.Array
    finished: jax.Array
    finished_scores: jax.Array
    is_finished: jax.Array
    open_rows: jax.Array


class _Rules(NamedTuple):
    """What a step needs besides the model: the tokens the new ones follow and their mask
    (int32 / bool [batch * beams, width], from `prefill`), the EOS ids, the processors, the
    length penalty, and the early-stopping mode as bool scalars."""

    prompt: jax.Array
    prompt_valid: jax.Array
    eos: jax.Array
    processors: LogitsProcessors
    length_penalty: jax.Array
    never: jax.Array
    stop_when_full: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "num_beams", "max_new_tokens"))
def _beam_search(graphdef, state, ids, mask, eos, pad_token_id, length_penalty, early_stopping,
                 processors: LogitsProcessors = NO_PROCESSORS, *, num_beams: int,
                 max_new_tokens: int):
    """The compiled program. Returns the finished hypotheses, best first: int32 tokens
    [batch, num_beams, max_new_tokens] and float32 scores [batch, num_beams]."""
    batch, beams, steps = ids.shape[0], num_beams, max_new_tokens
    logits, cache, head, prompt, prompt_valid = prefill(
        nnx.merge(graphdef, state), ids, mask, copies=beams, max_new_tokens=steps)
    rules = _Rules(prompt, prompt_valid, eos, processors, length_penalty,
                   (early_stopping == EARLY_STOPPING["never"]) & (length_penalty > 0),
                   early_stopping == EARLY_STOPPING[True])

    def unfinished(carry):
        i, *_, beams_now = carry
        return (i < steps) & jnp.any(beams_now.open_rows) & ~(
            rules.stop_when_full & jnp.all(beams_now.is_finished))

    def advance(carry):
        i, (weights, head), last, cache, beams_now = carry
        # Weights ride in the carry: NNX refuses outer-trace values under a nested trace.
        logits, cache = step(nnx.merge(graphdef, weights), head, last, cache)
        return (i + 1, (weights, head), *_select(i, logits, cache, beams_now, rules))

    first = _select(jnp.int32(0), logits, cache, _initial(batch, beams, steps, pad_token_id),
                    rules)
    carry = jax.lax.while_loop(unfinished, advance, (jnp.int32(1), (state, head), *first))
    return carry[-1].finished, carry[-1].finished_scores


def _select(i: jax.Array, logits: jax.Array, cache, beams: _Beams, rules: _Rules):
    """Step i (int32 scalar) of the search, given every beam's next-token logits
    [batch * num_beams, vocab]: returns the running beams' last tokens [batch * num_beams],
    the cache reordered to follow them, and the new state."""
    batch, width, steps = beams.running.shape
    history = jnp.concatenate([rules.prompt, beams.running.reshape(batch * width, steps)], 1)
    valid = jnp.concatenate([rules.prompt_valid, jnp.broadcast_to(
        jnp.arange(steps) < i, (batch * width, steps))], axis=1)
    log_probs = rules.processors(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1),
                                 history, valid, rules.prompt.shape[1] + i, i)
    vocab = log_probs.shape[-1]
    log_probs = log_probs.reshape(batch, width, vocab) + beams.running_scores[:, :, None]
    keep = max(2, 1 + rules.eos.shape[0]) * width
    scores, index = jax.lax.top_k(log_probs.reshape(batch, width * vocab), keep)
    source, token = index // vocab, index % vocab  # [batch, keep]
    candidates = _gather(beams.running, source).at[:, :, i].set(token)
    ends = jnp.isin(token, rules.eos) | (i + 1 >= steps)

    # The best candidates that go on become the running beams; the cache follows them.
    running_scores, chosen = jax.lax.top_k(jnp.where(ends, -jnp.inf, scores), width)
    running = _gather(candidates, chosen)
    cache = cache.take((jnp.arange(batch)[:, None] * width + _gather(source, chosen))
                       .reshape(-1))

    # Ending candidates among the first `width` join the finished hypotheses of open rows.
    take = ends & (jnp.arange(keep) < width) & (beams.open_rows & ~(
        jnp.all(beams.is_finished, axis=1) & rules.stop_when_full))[:, None]
    finished, finished_scores, is_finished = _join_finished(
        (beams.finished, beams.finished_scores, beams.is_finished), candidates,
        scores / (i + 1).astype(jnp.float32) ** rules.length_penalty, take)
    length = jnp.where(rules.never, steps, i + 1).astype(jnp.float32)
    open_rows = beams.open_rows & ~_settled(
        running_scores[:, 0] / length**rules.length_penalty, finished_scores, is_finished)
    return running[:, :, i].reshape(-1), cache, _Beams(
        running, running_scores, finished, finished_scores, is_finished, open_rows)


def _initial(batch: int, beams: int, steps: int, pad_token_id: jax.Array) -> _Beams:
    """The state before the first step: no tokens, no finished hypotheses, every row open."""
    running = jnp.full((batch, beams, steps), pad_token_id, jnp.int32)
    # Only the first beam is live at first, so that the beams do not all pick the same tokens.
    running_scores = jnp.zeros((batch, beams)).at[:, 1:].set(-1e9)
    return _Beams(running, running_scores, running, jnp.full((batch, beams), -jnp.inf),
                  jnp.zeros((batch, beams), bool), jnp.ones((batch,), bool))
