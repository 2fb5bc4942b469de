"""Log-probabilities of token continuations in fixed-shape batches: the numbers behind
`loglikelihood` and `loglikelihood_rolling` of `tfx.evaluation.TfxLM`, with no lm-eval import.

A request is a (context ids, continuation ids) pair; inputs longer than `max_length` + 1 lose
tokens on the left, as in lm-eval's hf backend (`(context + continuation)[-(max_length + 1):]`,
the context being what precedes the continuation's tokens there). Requests with the same
context share it: the context runs through the model once, into a KV cache, and each distinct
continuation then runs through a copy of that cache. A multiple-choice question costs its
prompt once plus a few tokens per choice, where a full row per choice would cost the prompt
once per choice (one-token choices need no second pass at all: the context's last position
scores them all). Contexts run longest first in batches of `batch_size`, padded to a few
lengths (`bucket`) so that one compiled program serves many batches; every batch is
dispatched before the first result is read, so the host builds the next one while the device
runs this one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["bucket", "continuation_logprobs"]


def bucket(length: int, limit: int) -> int:
    """The padded length for `length` tokens: the next multiple of an eighth of its octave (at
    least 8: 8, 16, 24, 32, 40, 48, 56, 64, 80, ...), at most `limit` (never below `length`).
    About four programs per doubling of length, and under 25% of padding."""
    step = max(8, 1 << max(0, length.bit_length() - 3))
    return max(length, min(-(-length // step) * step, limit))


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def continuation_logprobs(model: nnx.Module, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                          *, batch_size: int, max_length: int) -> list[tuple[float, bool]]:
    """Sum of log p(continuation | context) and whether greedy decoding yields it, per pair.

    Args:
      model: a tfx `Decoder` (`hidden_states(ids, attention_mask=, cache=)`, `init_cache`,
        `logits(hidden)` -> float32 [..., V]).
      pairs: (context ids, continuation ids), both non-empty, continuation at most max_length.
      batch_size: contexts per model call (the last batch is padded to it).
      max_length: the longest model input (context and continuation but its last token).
    Returns:
      [(log-prob summed over the continuation's tokens, every continuation token is the
      argmax)], in the order of `pairs`.
    """
    groups, where = _groups(pairs, max_length)
    order = sorted(groups, key=lambda context: (-len(context), context))
    graphdef, state = nnx.split(model)
    pending = []
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        arrays = _batch([(c, list(groups[c])) for c in chunk], batch_size, max_length)
        # Padding takes no cache slot, and a context with its continuation (but its last
        # token) holds at most max_length tokens.
        cache_len = min(arrays[0].shape[1] + arrays[3].shape[2], max_length)
        pending.append((chunk, _score(graphdef, state, *arrays, cache_len=cache_len)))
    scored = {}
    for chunk, outputs in pending:  # read back only now: the device ran ahead of the host
        first, best, rest, rest_greedy = (np.asarray(x) for x in outputs)
        for b, context in enumerate(chunk):
            scored[context] = first[b], best[b], rest[b], rest_greedy[b]
    results = []
    for context, continuation, column in where:
        first, best, rest, rest_greedy = scored[context]
        n = len(continuation) - 1  # tokens after the first, scored by the second pass
        logprob = float(first[column] + rest[column, :n].sum(dtype=np.float64))
        greedy = best == continuation[0] and rest_greedy[column, :n].all()
        results.append((logprob, bool(greedy)))
    return results


def _groups(pairs, max_length: int) -> tuple[dict[tuple, dict[tuple, int]], list]:
    """Contexts (after left-truncation) -> their distinct continuations -> column; and each
    pair's (context, continuation, column)."""
    groups: dict[tuple, dict[tuple, int]] = {}
    where = []
    for i, (context, continuation) in enumerate(pairs):
        if not len(context) or not len(continuation):
            raise ValueError(f"pairs[{i}]: context and continuation must be non-empty token "
                             f"lists, got {len(context)} and {len(continuation)} tokens")
        if len(continuation) > max_length:
            raise ValueError(f"pairs[{i}]: a continuation of {len(continuation)} tokens does "
                             f"not fit max_length={max_length}")
        continuation = tuple(int(t) for t in continuation)
        kept = max_length + 1 - len(continuation)  # context tokens that fit before it
        context = tuple(int(t) for t in context[-kept:])
        columns = groups.setdefault(context, {})
        where.append((context, continuation, columns.setdefault(continuation, len(columns))))
    return groups, where


def _batch(chunk: list[tuple[tuple, list[tuple]]], batch_size: int,
           max_length: int) -> tuple[np.ndarray, ...]:
    """Host arrays for `_score`: contexts left-padded [batch_size, length] with their mask,
    and per context `copies` continuation columns: first tokens [batch_size, copies], the
    rest as inputs (all tokens but the last), targets (all but the first) and mask
    [batch_size, copies, depth]. Shapes come from buckets, and missing contexts repeat the
    first, so few programs are compiled."""
    chunk = chunk + chunk[:1] * (batch_size - len(chunk))
    length = bucket(max(len(c) for c, _ in chunk), max_length)
    depth = max(len(t) - 1 for _, conts in chunk for t in conts)
    depth = depth and bucket(depth, max_length)
    copies = _power_of_two(max(len(conts) for _, conts in chunk))
    ids = np.zeros((batch_size, length), np.int32)
    mask = np.zeros((batch_size, length), bool)
    firsts = np.zeros((batch_size, copies), np.int32)
    inputs, targets = (np.zeros((batch_size, copies, depth), np.int32) for _ in range(2))
    valid = np.zeros((batch_size, copies, depth), bool)
    for b, (context, continuations) in enumerate(chunk):
        ids[b, length - len(context):], mask[b, length - len(context):] = context, True
        for c, continuation in enumerate(continuations):
            n = len(continuation) - 1
            firsts[b, c] = continuation[0]
            inputs[b, c, :n], targets[b, c, :n] = continuation[:-1], continuation[1:]
            valid[b, c, :n] = True
    return ids, mask, firsts, inputs, targets, valid


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len"))
def _score(graphdef, state, ids, mask, firsts, inputs, targets, valid, *, cache_len: int):
    """The contexts into a cache, then each continuation after a copy of its context's cache.

    Returns float32 [B, copies] log-probs of `firsts` after each context, int32 [B] the argmax
    there, float32 [B, copies, depth] log-probs of `targets` and bool [B, copies, depth]
    whether each is the argmax (both meaningless where not `valid`).
    """
    model = nnx.merge(graphdef, state)
    batch, (copies, depth) = ids.shape[0], inputs.shape[1:]
    cache = model.init_cache(batch, cache_len)
    hidden, cache = model.hidden_states(ids, attention_mask=mask, cache=cache)
    logprobs = jax.nn.log_softmax(model.logits(hidden[:, -1:])[:, 0], axis=-1)  # [B, V]
    first = jnp.take_along_axis(logprobs, firsts, axis=-1)
    best = jnp.argmax(logprobs, axis=-1).astype(jnp.int32)
    if depth == 0:  # one-token continuations only: the contexts' last positions scored them
        return first, best, jnp.zeros(inputs.shape), jnp.ones(inputs.shape, bool)
    cache = cache.take(jnp.repeat(jnp.arange(batch), copies))
    flat = (batch * copies, depth)
    hidden, _ = model.hidden_states(inputs.reshape(flat), attention_mask=valid.reshape(flat),
                                    cache=cache)
    logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1)  # [B * copies, depth, V]
    rest = jnp.take_along_axis(logprobs, targets.reshape(flat)[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logprobs, axis=-1) == targets.reshape(flat)
    return first, best, rest.reshape(inputs.shape), greedy.reshape(inputs.shape)
