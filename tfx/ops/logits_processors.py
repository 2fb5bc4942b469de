"""Logits processors: the maths of transformers' repetition penalty, n-gram blocking, bad words,
EOS suppression and stop sequences, on plain arrays.

Each function sees a row's tokens so far as a `history`: int [batch, length] with a bool `valid`
of the same shape, False for padding and for slots not yet filled, so that padding never counts
as a token. Decoding loops keep one fixed-size history per row (the given tokens, then the new
ones) and pass `end`, the number of slots before the next token's; everything is traceable, so
the values (penalty, n-gram size, token ids) are ordinary inputs of a compiled loop.

Token sequences (bad words, stop sequences) arrive as one int array [count, width], each
sequence right-aligned and left-padded with -1, which matches anything: a sequence matches the
history when its real tokens are the history's last ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ban_sequences", "ends_with", "no_repeat_ngram", "repetition_penalty",
           "suppress_tokens"]


def _marked(tokens: jax.Array, keep: jax.Array, vocab: int) -> jax.Array:
    """bool [batch, vocab]: True at the ids tokens [batch, n] hold where keep [batch, n]."""
    rows = jnp.arange(tokens.shape[0])[:, None]
    marks = jnp.zeros((tokens.shape[0], vocab + 1), bool)  # a spare column takes the unkept
    return marks.at[rows, jnp.where(keep, tokens, vocab)].set(True)[:, :vocab]


@jax.jit
def repetition_penalty(logits: jax.Array, history: jax.Array, valid: jax.Array,
                       penalty: jax.Array) -> jax.Array:
    """CTRL's repetition penalty (Keskar et al. 2019), as transformers applies it: the logit of
    every token present in the history is divided by `penalty` when positive and multiplied by
    it when negative.

    Args:
      logits: float [batch, vocab].
      history: int [batch, length]; valid: bool [batch, length] (only these tokens count).
      penalty: float scalar > 0 (1 changes nothing).
    Returns:
      float32 [batch, vocab].
    """
    logits = logits.astype(jnp.float32)
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(_marked(history, valid, logits.shape[1]), penalised, logits)


def _at(history: jax.Array, valid: jax.Array, positions: jax.Array):
    """history and valid at int positions [m] (any value; outside [0, length) is invalid)
    -> (tokens [batch, m], valid [batch, m])."""
    inside = (positions >= 0) & (positions < history.shape[1])
    index = jnp.clip(positions, 0, history.shape[1] - 1)
    return history[:, index], valid[:, index] & inside


@jax.jit
def no_repeat_ngram(logits: jax.Array, history: jax.Array, valid: jax.Array, end: jax.Array,
                    ngram_size: jax.Array) -> jax.Array:
    """Forbid every token that would repeat an n-gram of the history (transformers'
    NoRepeatNGramLogitsProcessor): wherever the last n - 1 tokens occurred before, followed by
    t, t gets -inf. n = 1 forbids every token seen.

    Args:
      logits: float [batch, vocab].
      history: int [batch, length]; valid: bool [batch, length]. An n-gram counts only when all
        its tokens are valid; when the last n - 1 are not (fewer real tokens than that so far),
        nothing is forbidden.
      end: int scalar, the slots before the next token's (history[:, end - 1] is the last).
      ngram_size: int scalar >= 1.
    Returns:
      float32 [batch, vocab].
    """
    starts = jnp.arange(history.shape[1])

    def matching(k, match):  # the k-th token of each n-gram equals the k-th of the suffix
        token, ok = _at(history, valid, starts + k)
        suffix, suffix_ok = _at(history, valid, (end - ngram_size + 1 + k)[None])
        return match & ok & suffix_ok & (token == suffix)

    match = jax.lax.fori_loop(0, ngram_size - 1, matching,
                              jnp.ones(history.shape, bool))
    last, last_ok = _at(history, valid, starts + ngram_size - 1)
    banned = _marked(last, match & last_ok, logits.shape[1])
    return jnp.where(banned, -jnp.inf, logits.astype(jnp.float32))


@jax.jit
def ends_with(history: jax.Array, valid: jax.Array, end: jax.Array,
              sequences: jax.Array) -> jax.Array:
    """Which sequences the history ends with at `end`.

    Args:
      history: int [batch, length]; valid: bool [batch, length].
      end: int scalar: the sequences must end at history[:, end - 1].
      sequences: int [count, width], right-aligned, -1 before a shorter sequence's tokens.
    Returns:
      bool [batch, count] (all True when width is 0: nothing to match).
    """
    width = sequences.shape[1]
    tokens, ok = _at(history, valid, end - width + jnp.arange(width))
    same = (tokens[:, None] == sequences[None]) & ok[:, None]
    return jnp.all(same | (sequences[None] < 0), axis=-1)


@jax.jit
def ban_sequences(logits: jax.Array, history: jax.Array, valid: jax.Array, end: jax.Array,
                  sequences: jax.Array) -> jax.Array:
    """Forbid the last token of every sequence whose other tokens end the history
    (transformers' NoBadWordsLogitsProcessor): single tokens always, longer sequences only
    when the next token would complete them.

    Args:
      logits: float [batch, vocab].
      history: as in `ends_with`.
      valid: as in `ends_with`.
      end: as in `ends_with`.
      sequences: int [count, width >= 1], right-aligned, -1 before a shorter one's tokens.
    Returns:
      float32 [batch, vocab].
    """
    hit = ends_with(history, valid, end, sequences[:, :-1])
    last = jnp.broadcast_to(sequences[:, -1], hit.shape)
    return jnp.where(_marked(last, hit, logits.shape[1]), -jnp.inf, logits.astype(jnp.float32))


@jax.jit
def suppress_tokens(logits: jax.Array, tokens: jax.Array, on: jax.Array) -> jax.Array:
    """logits float [batch, vocab] with tokens int [n] set to -inf where on (bool scalar or
    [batch]); float32. Ids outside [0, vocab) are ignored. Used to hold EOS back until a
    minimum number of new tokens (transformers' MinNewTokensLengthLogitsProcessor)."""
    hit = jnp.any(jnp.arange(logits.shape[1])[:, None] == tokens[None], axis=-1)
    on = jnp.reshape(on, (-1, 1))
    return jnp.where(on & hit[None], -jnp.inf, logits.astype(jnp.float32))
