"""Argument checks and prompt layout shared by `generate`, `beam_search`,
`speculative_generate` and the `Engine`, run on the host before anything compiles (so a bad
value never reaches the compiled loop, and checks add no recompiles).

Numbers may be Python or numpy scalars (np.float32(0.5), np.int64(3)); NaN and infinities are
refused, as are bools where a number is expected.
"""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp
import numpy as np

from tfx.models import checks
from tfx.models.config import TransformerConfig

__all__ = ["bucket_length", "decoder_prompt", "fits", "integer", "prompt_and_mask", "real",
           "sampling_filters", "source_fits", "token_ids"]

MIN_BUCKET = 16


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


def pad_id(config: TransformerConfig, pad_token_id, eos: list[int]) -> int:
    """The filler after EOS: `pad_token_id`, else the config's `embeddings.pad_id`, else the
    first EOS id (else 0), checked to be in the vocabulary."""
    if pad_token_id is None:
        pad_token_id = config.embeddings.pad_id
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return token_ids("pad_token_id", pad_token_id, config.vocab_size)[0]


def integer(name: str, value, *, minimum: int = 1) -> int:
    """A Python or numpy int >= minimum, as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def real(name: str, value, *, low: float = -math.inf, high: float = math.inf,
         open_low: bool = False, hint: str = "") -> float:
    """A finite Python or numpy real number in [low, high] ((low, high] with open_low), as a
    float; `hint` ends the message."""
    finite = (not isinstance(value, bool) and isinstance(value, numbers.Real)
              and math.isfinite(value))
    if not (finite and (value > low if open_low else value >= low) and value <= high):
        if high < math.inf:
            bounds = f" in {'(' if open_low else '['}{low:g}, {high:g}]"
        else:
            bounds = "" if low == -math.inf else f" {'>' if open_low else '>='} {low:g}"
        raise ValueError(f"{name} must be a finite number{bounds}{hint}, got {value!r}")
    return float(value)


def sampling_filters(temperature, top_k, top_p, rng) -> dict:
    """Validate the sampling arguments; returns the filters as traced values (None = off)."""
    temperature = real("temperature", temperature, low=0.0, hint=" (0 is greedy)")
    if top_k is not None:
        top_k = integer("top_k", top_k)
    if top_p is not None:
        top_p = real("top_p", top_p, low=0.0, high=1.0, open_low=True, hint=" or None")
    if temperature > 0 and rng is None:
        raise ValueError("rng must be a jax.random key when temperature > 0 "
                         "(temperature=0.0 decodes greedily)")
    return {"temperature": jnp.float32(temperature),
            "top_k": None if top_k is None else jnp.int32(top_k),
            "top_p": None if top_p is None else jnp.float32(top_p)}


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
