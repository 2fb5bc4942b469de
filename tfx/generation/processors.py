"""Logits processors for `tfx.generate` and `tfx.beam_search`, as one value that rides into the
compiled loop.

`LogitsProcessors` holds each processor's values as arrays, or None when it is off; which are on
is part of the pytree's structure (so of the compiled program), their values are inputs (a new
penalty, n-gram size or list of words of the same shape does not recompile). It applies them
in the order of transformers' `GenerationMixin._get_logits_processor`: repetition penalty,
no-repeat n-grams, bad words, minimum new tokens; decoding applies temperature / top-k / top-p
after them (`generate`), and beam search applies them to the log-probabilities (as
transformers' `_beam_search` does). Stop sequences are not a processor but a stopping rule
(`stopped`): a row whose newest tokens complete one is finished as if it had produced EOS.

The maths is in `tfx.ops.logits_processors`; here are the argument checks (on the host, before
anything compiles) and the order.

Padding never counts as a token: the processors see each row's real tokens (the prompt without
its padding, on either side; for an encoder–decoder the decoder start token, as transformers),
then the new ones. transformers (5.x) skips left padding in its repetition penalty too
(`prompt_ignore_length`), but its no-repeat n-grams and multi-token bad words read the padding
ids as tokens, so the two differ only when a row's real tokens match an n-gram or a bad-word
prefix made of padding ids (and when fewer than n - 1 real tokens precede the next one, where
tfx forbids nothing).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tfx.generation._inputs import integer, real, token_ids
from tfx.ops import logits_processors as ops

__all__ = ["LogitsProcessors", "logits_processors"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsProcessors:
    """What to do to each step's logits (every field None: nothing).

    repetition_penalty: float32 scalar > 0 (transformers' `repetition_penalty`).
    no_repeat_ngram_size: int32 scalar >= 1.
    bad_words: int32 [count, width]: the bad words, right-aligned, -1 before shorter ones.
    min_new_tokens: int32 scalar; EOS is held back while fewer tokens have been generated.
    eos: int32 [n]: the EOS ids `min_new_tokens` holds back (set with it).
    stop_sequences: int32 [count, width], laid out as bad_words.
    """

    repetition_penalty: jax.Array | None = None
    no_repeat_ngram_size: jax.Array | None = None
    bad_words: jax.Array | None = None
    min_new_tokens: jax.Array | None = None
    eos: jax.Array | None = None
    stop_sequences: jax.Array | None = None

    def __call__(self, logits: jax.Array, history: jax.Array, valid: jax.Array,
                 end: jax.Array, generated: jax.Array) -> jax.Array:
        """The processed logits, float32 [batch, vocab].

        logits: float [batch, vocab] (or log-probabilities) for the token at slot `end`.
        history: int [batch, length], each row's tokens: prompt, then the new ones.
        valid: bool [batch, length], False for padding and for slots not yet filled.
        end: int scalar, the slots before the next token's; generated: int scalar, how many
          of them are new tokens.
        """
        logits = logits.astype(jnp.float32)
        if self.repetition_penalty is not None:
            logits = ops.repetition_penalty(logits, history, valid, self.repetition_penalty)
        if self.no_repeat_ngram_size is not None:
            logits = ops.no_repeat_ngram(logits, history, valid, end, self.no_repeat_ngram_size)
        if self.bad_words is not None:
            logits = ops.ban_sequences(logits, history, valid, end, self.bad_words)
        if self.min_new_tokens is not None:
            logits = ops.suppress_tokens(logits, self.eos, generated < self.min_new_tokens)
        return logits

    def stopped(self, history: jax.Array, valid: jax.Array, end: jax.Array) -> jax.Array:
        """bool [batch]: rows whose tokens up to slot end - 1 end with a stop sequence (all
        False without stop sequences)."""
        if self.stop_sequences is None:
            return jnp.zeros(history.shape[:1], bool)
        return jnp.any(ops.ends_with(history, valid, end, self.stop_sequences), axis=1)


def logits_processors(vocab_size: int, eos: list[int], *, repetition_penalty=None,
                      no_repeat_ngram_size=None, min_new_tokens=None, bad_words_ids=None,
                      stop_sequences=None) -> LogitsProcessors:
    """Check the processor arguments (transformers' names and meanings) and lay them out.

    Args:
      vocab_size: of the model; eos: the checked EOS ids (may be empty).
      repetition_penalty: finite float > 0, or None (off).
      no_repeat_ngram_size: int >= 0 (0 or None: off).
      min_new_tokens: int >= 0 (0 or None: off); needs eos.
      bad_words_ids: a list of non-empty lists of token ids, or None. As in transformers, a
        single-token bad word that is an EOS id is dropped.
      stop_sequences: a list of non-empty lists of token ids, or None.
    Raises:
      ValueError: naming the argument, for a value out of range or of the wrong form.
    """
    fields = {}
    if repetition_penalty is not None:
        fields["repetition_penalty"] = jnp.float32(
            real("repetition_penalty", repetition_penalty, low=0.0, open_low=True,
                 hint=" (1 changes nothing) or None"))
    if no_repeat_ngram_size is not None and integer(
            "no_repeat_ngram_size", no_repeat_ngram_size, minimum=0):
        fields["no_repeat_ngram_size"] = jnp.int32(no_repeat_ngram_size)
    if min_new_tokens is not None and integer("min_new_tokens", min_new_tokens, minimum=0):
        if not eos:
            raise ValueError("min_new_tokens holds EOS back: it needs eos_token_id")
        fields["min_new_tokens"] = jnp.int32(min_new_tokens)
        fields["eos"] = jnp.asarray(eos, jnp.int32)
    if bad_words_ids is not None:
        words = [w for w in _sequences("bad_words_ids", bad_words_ids, vocab_size)
                 if not (len(w) == 1 and w[0] in eos)]
        if words:
            fields["bad_words"] = _right_aligned(words)
    if stop_sequences is not None:
        fields["stop_sequences"] = _right_aligned(
            _sequences("stop_sequences", stop_sequences, vocab_size))
    return LogitsProcessors(**fields)


def _sequences(name: str, value, vocab_size: int) -> list[list[int]]:
    """A non-empty list of non-empty token id sequences, each id in [0, vocab_size)."""
    form = f"{name} must be a non-empty list of non-empty lists of token ids"
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple | np.ndarray):
        raise ValueError(f"{form}, got {value!r}")
    sequences = []
    for sequence in value:
        if not isinstance(sequence, list | tuple | np.ndarray) or not len(sequence):
            raise ValueError(f"{form}, got {value!r}")
        sequences.append(token_ids(name, list(sequence), vocab_size))
    if not sequences:
        raise ValueError(f"{form}, got {value!r}")
    return sequences


def _right_aligned(sequences: list[list[int]]) -> jax.Array:
    """int32 [count, longest]: each sequence at the right, -1 before it."""
    width = max(map(len, sequences))
    return jnp.asarray([[-1] * (width - len(s)) + s for s in sequences], jnp.int32)
