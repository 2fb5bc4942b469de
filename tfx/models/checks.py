"""Checks of the values that models are called with: token ids, token types, learned positions
and room in a KV cache. Each failure raises ValueError naming the argument, the offending value
(and where it is) and the allowed range; nothing is clamped.

Shapes and dtypes are static, so they are checked whenever a model is called or traced. Values
are checked where they are known:
- on concrete arrays (a model called eagerly, e.g. in a notebook), always;
- on traced values (inside `jax.jit`, `nnx.jit`, `lax.scan`...), only in checked mode, i.e.
  inside a function wrapped by `checked`: the same checks then run as
  `jax.experimental.checkify` checks and raise the same message when the compiled program runs.
  Outside checked mode a traced call adds nothing to the program.
Arrays spread over several processes cannot be read by one; they too are checked only in
checked mode.

Why: a gather with an index past its table (`jnp.take`) returns NaN, and a negative index wraps
around to the end of the table, so a bad id would otherwise give NaN logits or, worse, plausible
wrong ones; a linear KV cache drops the writes that do not fit.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from tfx.models.config import TransformerConfig
from tfx.ops.kv_cache import KVCache

__all__ = ["cache_room", "checked", "ids_array", "in_range", "learned_positions", "same_shape",
           "token_ids"]

# True while `checked` traces its function: only then do traced values get checkify checks.
_CHECKED = contextvars.ContextVar("tfx_checked_mode", default=False)


def checked(fn: Callable) -> Callable:
    """Compile `fn` with the models' value checks on ("checked mode").

    `checked(fn)(*args)` is `jax.jit(fn)(*args)` in which every model call also checks its ids,
    token types, positions and cache room (`jax.experimental.checkify` with
    `errors=checkify.user_checks`), raising `checkify.JaxRuntimeError` (a ValueError) with the
    message an eager call gives. Use it to debug a jitted step; the plain `jax.jit(fn)` pays
    nothing for the checks.

    >>> logits = tfx.models.checked(lambda model, ids: model(ids))(model, ids)

    Args:
      fn: the plain function (not a `jax.jit` of it: a jitted function could reuse a trace
        made without the checks); its arguments are pytrees of arrays (NNX modules are).
    """
    if hasattr(fn, "lower"):
        raise TypeError("checked(fn) takes the plain function and compiles it itself; "
                        "pass fn, not jax.jit(fn), whose cached trace may hold no checks")

    def in_checked_mode(*args, **kwargs):
        token = _CHECKED.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _CHECKED.reset(token)

    # The inner jit gives NNX modules a jit trace to run in: they refuse to update their state
    # (dropout's rng counts) directly under checkify's own trace.
    compiled = jax.jit(checkify.checkify(jax.jit(in_checked_mode),
                                         errors=checkify.user_checks))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        error, out = compiled(*args, **kwargs)
        error.throw()
        return out

    return run


def ids_array(name: str, ids) -> None:
    """Require an int [batch, seq] array (jax or numpy; a Python list is a TypeError, since
    under jit it would be a structure of Python ints rather than one traced array)."""
    if not (hasattr(ids, "shape") and hasattr(ids, "dtype")):
        raise TypeError(f"{name} must be a jax or numpy int array [batch, seq], got "
                        f"{type(ids).__name__} (wrap it with jnp.asarray)")
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be int [batch, seq], got {ids.dtype} {tuple(ids.shape)}")


def token_ids(name: str, ids, vocab_size: int) -> None:
    """Require int [batch >= 1, seq >= 1] ids in [0, vocab_size).

    An empty batch or an empty sequence has no token to compute anything from (no logits to
    sample, no [CLS] to pool), so it is refused rather than passed to the layers.
    """
    ids_array(name, ids)
    if 0 in ids.shape:
        raise ValueError(f"{name} must hold at least one sequence of at least one token, got "
                         f"shape {tuple(ids.shape)}")
    in_range(name, ids, 0, vocab_size, "the vocabulary, vocab_size")


def same_shape(name: str, x, reference_name: str, reference) -> None:
    """Require the array `x` to have `reference`'s shape (no silent broadcast)."""
    if not hasattr(x, "shape"):
        raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
    if tuple(x.shape) != tuple(reference.shape):
        raise ValueError(f"{name} must have the shape of {reference_name} "
                         f"{tuple(reference.shape)}, got {tuple(x.shape)}")


def in_range(name: str, x, low: int, high: int, what: str) -> None:
    """Require every value of the int array `x` to be in [low, high); `what` says what the
    bound is, for the message."""
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int array, got {getattr(x, 'dtype', type(x))}")
    where = ", ".join(f"{{i{d}}}" for d in range(np.ndim(x)))
    message = (f"{name} must be in [{low}, {high}) ({what} = {high}), got {{value}} at "
               f"{name}[{where}]")
    # Bounds clipped to what the dtype holds (a bound beyond it is always met): an unclipped
    # one would overflow in a traced comparison.
    info = np.iinfo(x.dtype)
    lowest, highest = max(low, info.min), min(high - 1, info.max)

    def ok(values):
        return (values >= lowest) & (values <= highest), {"value": values}

    _require(message, ok, x)


def learned_positions(name: str, positions, config: TransformerConfig, offset: int = 0) -> None:
    """Require `positions` (int, any shape) in [0, config.max_len - offset) when the model has a
    learned position table (offset: the leading vectors in front, `tfx.models.leading`);
    no-op otherwise."""
    if config.position == "learned":
        in_range(name, positions, 0, config.max_len - offset,
                 "the learned position table, config.max_len"
                 + (f" - {offset} leading vectors" if offset else ""))


def cache_room(name: str, cache: KVCache, valid, config: TransformerConfig) -> None:
    """Require a call's tokens to fit its KV cache.

    A linear cache holds positions [0, cache_len); a learned position table [0, config.max_len).
    A ring buffer (sliding window) has no limit of its own.

    Args:
      name: the tokens' argument, for the message.
      cache: the KVCache the call continues.
      valid: bool [batch, q_len], the call's real tokens (padding takes no slot).
    """
    limits = []
    if cache.window is None:
        limits.append((cache.positions.shape[1], "the KV cache holds (init_cache max_len)"))
    if config.position == "learned":
        limits.append((config.max_len, "the learned position table holds (config.max_len)"))
    if not limits:
        return
    limit, what = min(limits)
    message = (f"{name} does not fit: row {{i0}} has {{cached}} tokens cached and feeds "
               f"{{fed}} more, beyond the {limit} that {what}")

    def ok(next_position, valid):
        fed = valid.sum(axis=1)
        return next_position + fed <= limit, {"cached": next_position, "fed": fed}

    _require(message, ok, cache.next_position, valid)


def _concrete(x) -> bool:
    """Whether `x`'s values can be read here: not a tracer, and on this process's devices."""
    return not isinstance(x, jax.core.Tracer) and getattr(x, "is_fully_addressable", True)


def _require(message: str, ok: Callable, *arrays) -> None:
    """Raise ValueError(message) unless `ok(*arrays)` holds everywhere.

    ok: (*arrays) -> (bool array, {field: array broadcastable to it}); written with operators
      and methods that numpy and jax arrays share, so it runs on the host for concrete arrays
      and in the traced program in checked mode.
    message: a str.format template over the fields and i0, i1, ... (the index), filled in at the
      first element where ok is False.
    """
    if all(_concrete(x) for x in arrays):
        passed, fields = ok(*(np.asarray(x) for x in arrays))
        if not passed.all():
            index = np.unravel_index(np.argmin(passed), passed.shape)
            values = {k: np.broadcast_to(v, passed.shape)[index] for k, v in fields.items()}
            raise ValueError(message.format(**values, **_index_fields(index)))
    elif _CHECKED.get():
        passed, fields = ok(*(jnp.asarray(x) for x in arrays))
        first = jnp.argmin(passed.ravel())
        index = jnp.unravel_index(first, passed.shape)
        values = {k: jnp.broadcast_to(v, passed.shape).ravel()[first] for k, v in fields.items()}
        checkify.check(jnp.all(passed), message, **values, **_index_fields(index))


def _index_fields(index) -> dict:
    return {f"i{d}": i for d, i in enumerate(index)}
