"""Argument checks and prompt layout shared by `generate`, `beam_search`,
`speculative_generate` and the `Engine`, run on the host before anything compiles (so a bad
value never reaches the compiled loop, and checks add no recompiles).

Numbers may be Python or numpy scalars (np.float32(0.5), np.int64(3)); NaN and infinities are
refused, as are bools where a number is expected.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from tfx.generation._numbers import integer, real
from tfx.generation.config import GenerationConfig
from tfx.models import checks
from tfx.models.config import TransformerConfig

__all__ = ["DEFAULT_SEED", "bucket_length", "decoder_prompt", "fits", "integer",
           "outside_jit", "prompt_and_mask", "real", "sampling_filters", "sampling_key",
           "source_fits", "special_ids", "token_ids"]

MIN_BUCKET = 16
DEFAULT_SEED = 0  # of the key a sampling call without `rng` draws with


def prompt_and_mask(input_ids, attention_mask,
                    vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """int [batch >= 1, length >= 1] ids in [0, vocab_size) and their mask (all True when
    None; otherwise of the ids' shape, nonzero = real token), as the models take them (jax or
    numpy arrays or nested lists, `tfx.models.checks`), on the host as numpy arrays. Padding
    ids are checked too: the model embeds them before the mask hides them."""
    ids, mask = checks.ids_and_mask("input_ids", input_ids, "attention_mask", attention_mask,
                                    vocab_size)
    ids = np.asarray(ids)
    if mask is None:
        return ids, np.ones(ids.shape, bool)
    mask = np.asarray(mask).astype(bool)
    if not mask.any(axis=1).all():
        raise ValueError("attention_mask has a row without any real token")
    return ids, mask


def source_fits(config: TransformerConfig, source_len: int) -> None:
    """An encoder–decoder's source must fit a learned position table."""
    if config.position == "learned" and source_len > config.max_len:
        raise ValueError(f"input_ids has {source_len} tokens, more than the model's learned "
                         f"position table holds (config.max_len = {config.max_len})")


def token_ids(name: str, value, vocab_size: int) -> list[int]:
    """Token id(s) as a list of ints in [0, vocab_size) (None: empty)."""
    values = [] if value is None else [value] if np.isscalar(value) else list(value)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < vocab_size:
            raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {value!r}")
    return [int(v) for v in values]


def special_ids(config: TransformerConfig, defaults: GenerationConfig, eos_token_id,
                pad_token_id) -> tuple[list[int], int]:
    """(EOS ids, the filler after EOS) of a decoding call: the given ones (checked), the unset
    (None) ones from the model's generation config (`defaults`), whose ids past the vocabulary
    are dropped: such an EOS is never produced, and transformers never stops at it either.
    See `pad_id` for the filler's fallbacks."""
    if eos_token_id is None:
        eos = [i for i in defaults.eos_token_id if i < config.vocab_size]
    else:
        eos = token_ids("eos_token_id", eos_token_id, config.vocab_size)
    configured = defaults.pad_token_id
    if pad_token_id is None and configured is not None and configured < config.vocab_size:
        pad_token_id = configured
    return eos, pad_id(config, pad_token_id, eos)


def pad_id(config: TransformerConfig, pad_token_id, eos: list[int]) -> int:
    """The filler after EOS: `pad_token_id`, else the config's `embeddings.pad_id`, else the
    first EOS id (else 0), checked to be in the vocabulary."""
    if pad_token_id is None:
        pad_token_id = config.embeddings.pad_id
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return token_ids("pad_token_id", pad_token_id, config.vocab_size)[0]


def sampling_filters(temperature, top_k, top_p) -> dict:
    """Validate the sampling arguments; returns the filters as traced values (None = off; top_k
    0 is off too, as in transformers)."""
    temperature = real("temperature", temperature, low=0.0, hint=" (0 is greedy)")
    if top_k is not None:
        top_k = integer("top_k", top_k, minimum=0) or None
    if top_p is not None:
        top_p = real("top_p", top_p, low=0.0, high=1.0, open_low=True, hint=" or None")
    return {"temperature": jnp.float32(temperature),
            "top_k": None if top_k is None else jnp.int32(top_k),
            "top_p": None if top_p is None else jnp.float32(top_p)}


def sampling_key(rng: jax.Array | None, filters: dict) -> jax.Array | None:
    """The key to sample with: `rng`, or when sampling (temperature > 0) without one
    jax.random.key(DEFAULT_SEED), so that a call without a key is reproducible; None when
    greedy without one."""
    if rng is None and float(filters["temperature"]) > 0:
        return jax.random.key(DEFAULT_SEED)
    return rng


def outside_jit(name: str, *values) -> None:
    """TypeError when any leaf of `values` (arrays, models' states, nested lists) is a tracer:
    `name` checks its inputs and lays out its output on the host and compiles its own loop,
    so it cannot run under a jax transform."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(values)):
        raise TypeError(f"{name} compiles its own decoding loop (once per shape, reused after) "
                        "and must be called outside jax.jit / nnx.jit and other jax "
                        "transforms; it got traced values: call it from plain Python")


def bucket_length(length: int, limit: int | None = None) -> int:
    """The padded prompt length compiled for `length` tokens: the next power of two (at least
    16), capped at `limit` (the model's max_len minus the new tokens) but never below length."""
    bucket = max(MIN_BUCKET, 1 << (length - 1).bit_length())
    return max(length, min(bucket, limit)) if limit is not None else bucket


def decoder_prompt(max_len: int, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int, *,
                   bucket: bool) -> tuple[np.ndarray, np.ndarray]:
    """A decoder's prompts as its decoding loops take them: checked to fit `max_len` with the
    new tokens, padded (masked) to `bucket_length` when bucket, and left-aligned, which places
    tokens exactly as given (positions follow the mask), keeps Transformer-XL memories
    contiguous and puts every row's last token in the last column.

    ids: int [batch, length]; mask: bool [batch, length], on the host. Returns both
    [batch, padded length].
    """
    fits(int(mask.sum(axis=1).max()), max_new_tokens, max_len)
    width = bucket_length(ids.shape[1], max_len - max_new_tokens) if bucket else ids.shape[1]
    pad = ((0, 0), (0, width - ids.shape[1]))
    ids, mask = np.pad(ids, pad), np.pad(mask, pad)
    order = np.argsort(mask, axis=1, kind="stable")  # padding first, real tokens in order
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(mask, order, axis=1)


def fits(prompt: int, max_new_tokens: int, max_len: int) -> None:
    """prompt + max_new_tokens tokens must fit the model's max_len."""
    if prompt + max_new_tokens > max_len:
        raise ValueError(f"prompt ({prompt} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's max_len ({max_len})")
