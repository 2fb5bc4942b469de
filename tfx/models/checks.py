"""Checks of the values that models are called with: token ids and masks, token types, learned
positions (given ones and the length of a sequence) and room in a KV cache. Each failure raises
ValueError naming the argument, the offending value (and where it is) and the allowed range;
nothing is clamped.

Inputs are jax or numpy arrays or nested Python lists (taken as `jnp.asarray` takes them); any
other type is a TypeError. Shapes and dtypes are static, so they are checked whenever a model is
called or traced (a sequence longer than a learned position table, too). Values are checked where
they are known:
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
from tfx.ops.paged import PagedCache

__all__ = ["as_array", "cache_room", "checked", "ids_and_mask", "ids_array", "in_range",
           "int_array", "positions", "same_shape", "sequence_fits", "token_ids"]

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


def as_array(name: str, x, layout: str = "[batch, seq]"):
    """`x` as an array: a jax or numpy array as it is, a nested list or tuple (of ints, bools or
    arrays, traced ones too) through `jnp.asarray`; anything else is a TypeError. A ragged
    list is a ValueError."""
    if isinstance(x, list | tuple):
        try:
            return jnp.asarray(x)
        except (TypeError, ValueError):
            raise ValueError(f"{name} ({layout}): a nested list must hold numbers in rows of "
                             f"one length, got a ragged or mixed list") from None
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be a jax or numpy array {layout} (or a nested list), got "
                        f"{type(x).__name__}")
    return x


def ids_array(name: str, ids):
    """Require int [batch, seq] ids (a jax or numpy array or a nested list); returns them as an
    array."""
    ids = as_array(name, ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be int [batch, seq], got {ids.dtype} {tuple(ids.shape)}")
    return ids


def token_ids(name: str, ids, vocab_size: int):
    """Require int [batch >= 1, seq >= 1] ids in [0, vocab_size); returns them as an array.

    An empty batch or an empty sequence has no token to compute anything from (no logits to
    sample, no [CLS] to pool), so it is refused rather than passed to the layers.
    """
    ids = ids_array(name, ids)
    if 0 in ids.shape:
        raise ValueError(f"{name} must hold at least one sequence of at least one token, got "
                         f"shape {tuple(ids.shape)}")
    in_range(name, ids, 0, vocab_size, "the vocabulary, vocab_size")
    return ids


def ids_and_mask(ids_name: str, ids, mask_name: str, mask, vocab_size: int):
    """`token_ids` and their optional padding mask (bool, int or float [batch, seq] of their
    shape, nonzero = real token), both as arrays (the mask None when not given)."""
    ids = token_ids(ids_name, ids, vocab_size)
    if mask is None:
        return ids, None
    mask = same_shape(mask_name, mask, ids_name, ids)
    if not (jnp.issubdtype(mask.dtype, jnp.bool_) or jnp.issubdtype(mask.dtype, jnp.number)):
        raise ValueError(f"{mask_name} must be bool or numbers (1 = real token), got {mask.dtype}")
    return ids, mask


def int_array(name: str, x, reference_name: str | None = None, reference=None):
    """Require an int array (or nested list) of any shape, or of `reference`'s shape when one
    is given; returns it as an array."""
    x = as_array(name, x, "of ints") if reference is None else same_shape(
        name, x, reference_name, reference)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int array, got {x.dtype}")
    return x


def segment_ids(name: str, x, ids_name: str, ids, leading: int = 0):
    """Packed sequences' segment ids: None, or an int array of the ids' shape; refused beside
    `leading` vectors, which sit before the whole row (no segment of their own)."""
    if x is None:
        return None
    x = int_array(name, x, ids_name, ids)
    if leading:
        raise ValueError(f"{name} (packed sequences) cannot be used with leading vectors, "
                         "which sit before the whole row")
    return x


def same_shape(name: str, x, reference_name: str, reference):
    """Require the array (or nested list) `x` to have `reference`'s shape (no silent
    broadcast); returns it as an array."""
    x = as_array(name, x, f"of the shape of {reference_name}")
    if tuple(x.shape) != tuple(reference.shape):
        raise ValueError(f"{name} must have the shape of {reference_name} "
                         f"{tuple(reference.shape)}, got {tuple(x.shape)}")
    return x


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


def sequence_fits(name: str, ids, config: TransformerConfig, offset: int = 0) -> None:
    """Require the ids [batch, seq] at the default positions 0 .. seq - 1 (after `offset`
    leading vectors, `tfx.models.leading`) to fit a learned position table: offset + seq <=
    config.max_len. A shape, so checked under any jit. Other positional encodings have no
    table: config.max_len limits nothing there."""
    room = config.max_len - offset
    if config.position == "learned" and ids.shape[1] > room:
        raise ValueError(f"{name} has {ids.shape[1]} tokens, which exceeds the learned "
                         f"position table (config.max_len{_leading(offset)} = {room})")


def positions(name: str, positions, ids_name: str, ids, config: TransformerConfig,
              offset: int = 0):
    """A call's position ids -> None or them as an int array: None (the default positions)
    must fit as `sequence_fits`; given ones, with a learned position table, must be in
    [0, config.max_len - offset) (offset: the leading vectors in front)."""
    if positions is None:
        sequence_fits(ids_name, ids, config, offset)
        return None
    positions = int_array(name, positions)
    if config.position == "learned":
        in_range(name, positions, 0, config.max_len - offset,
                 f"the learned position table, config.max_len{_leading(offset)}")
    return positions


def _leading(offset: int) -> str:
    return f" - {offset} leading vectors" if offset else ""


def cache_room(name: str, cache: KVCache | PagedCache, valid, config: TransformerConfig) -> None:
    """Require a call's tokens to fit its KV cache.

    A linear cache holds positions [0, cache_len); a learned position table [0, config.max_len).
    A ring buffer (sliding window) has no limit of its own; a paged cache holds
    pages_per_seq * page_size.

    Args:
      name: the tokens' argument, for the message.
      cache: the KVCache or PagedCache the call continues.
      valid: bool [batch, q_len], the call's real tokens (padding takes no slot).
    """
    limits = []
    if isinstance(cache, PagedCache):
        limits.append((cache.capacity, "the page table holds (pages_per_seq * page_size)"))
    elif cache.window is None:
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
