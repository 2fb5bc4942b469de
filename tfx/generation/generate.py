"""`tfx.generate`: sampling or greedy decoding with a KV cache, compiled once.

One call is one compiled program: prefill the whole prompt in a single model call, then a
`lax.while_loop` that feeds one token per step through the cache until `max_new_tokens` or until
every sequence has produced EOS. It is compiled once per (model structure, batch, prompt-length
bucket, max_new_tokens, which filters are on); the sampling values (temperature, top_k, top_p)
and the prompt itself are ordinary inputs, so changing them does not recompile.
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
from tfx.models.decoder import Decoder
from tfx.models.encoder_decoder import EncoderDecoder
from tfx.ops.sampling import sample_logits

__all__ = ["bucket_length", "generate"]

MIN_BUCKET = 16


def bucket_length(length: int, limit: int | None = None) -> int:
    """The padded prompt length compiled for `length` tokens: the next power of two (at least
    16), capped at `limit` (the model's max_len minus the new tokens) but never below length."""
    bucket = max(MIN_BUCKET, 1 << (length - 1).bit_length())
    return max(length, min(bucket, limit)) if limit is not None else bucket


def generate(model: Decoder | EncoderDecoder, input_ids, *, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             rng: jax.Array | None = None, attention_mask=None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             bucket: bool = True, return_lengths: bool = False):
    """Continue prompts with a KV cache.

    Args:
      model: a `tfx.models.Decoder` (GPT-2, LLaMA, Mistral...) or `EncoderDecoder` (T5).
      input_ids: int [batch, prompt_len] (an array or nested lists), ids in [0, vocab_size),
        batch and prompt_len >= 1: the prompts (decoders) or the source (encoder–decoders).
      max_new_tokens: tokens to generate per sequence (int >= 1).
      temperature: 0.0 is greedy; > 0 (finite) samples from softmax(logits / temperature).
      top_k: keep the k most likely tokens (int >= 1; k >= vocab_size keeps all), or None.
      top_p: nucleus sampling: keep the most likely tokens whose probability reaches top_p, in
        (0, 1], or None.
      rng: a jax.random key, required when temperature > 0.
      attention_mask: [batch, prompt_len], 1 for real tokens and 0 for padding (left or right).
      eos_token_id: token id(s) that end a sequence; after it a sequence emits `pad_token_id`.
      pad_token_id: filler after EOS, in [0, vocab_size). Default: the model config's
        `embeddings.pad_id` (`tfx.hf.load` sets it from config.json's `pad_token_id`: T5's 0),
        else the first eos_token_id (else 0).
      bucket: pad the prompt (masked) to a power-of-two length so that nearby prompt lengths
        share one compiled program.
      return_lengths: also return each row's length (the numpy convention of
        `return_index=`-style flags: the result becomes a tuple).
    Returns:
      int32 [batch, prompt_len + max_new_tokens] for decoders (the prompt as given, padding
      included, then the new tokens), or [batch, 1 + max_new_tokens] for encoder–decoders
      (decoder start token, then new tokens). With return_lengths, `(tokens, lengths)`:
      lengths int32 [batch], the columns before the new tokens (all prompt_len columns of a
      decoder's prompt, left or right padding included; the start token of an encoder–decoder)
      plus the new tokens up to and including the row's first EOS (all max_new_tokens without
      one), so `tokens[i, :lengths[i]]` is row i without its filler; subtract the prompt
      mask's zeros for a count of real tokens.
    Raises:
      ValueError: before anything compiles, for an argument out of range (numbers may be
        Python or numpy scalars; NaN and infinities are refused), or a prompt +
        max_new_tokens longer than the model's max_len (its learned positions or its cache).
    """
    if not isinstance(model, Decoder | EncoderDecoder):
        raise TypeError(f"model must be a tfx Decoder or EncoderDecoder, got "
                        f"{type(model).__name__}")
    config = model.config
    ids, mask = prompt_and_mask(input_ids, attention_mask, config.vocab_size)
    seq2seq = isinstance(model, EncoderDecoder)
    max_new_tokens = integer("max_new_tokens", max_new_tokens)
    filters = _check_sampling(temperature, top_k, top_p, rng)
    eos = token_ids("eos_token_id", eos_token_id, config.vocab_size)
    pad_token_id = pad_id(config, pad_token_id, eos)
    prompt_len = ids.shape[1]
    if seq2seq:
        needed, cap = 1 + max_new_tokens, config.max_len
        source_fits(config, prompt_len)
    else:
        needed = int(mask.sum(axis=1).max()) + max_new_tokens
        cap = config.max_len - max_new_tokens
    if needed > config.max_len:
        raise ValueError(f"prompt ({needed - max_new_tokens} tokens) + max_new_tokens "
                         f"({max_new_tokens}) exceeds the model's max_len ({config.max_len})")
    padded_len = bucket_length(prompt_len, cap) if bucket else prompt_len
    pad = padded_len - prompt_len
    # An encoder's source keeps its layout (absolute positions see real tokens where they were),
    # padded on the right; a decoder's prompt is left-aligned, which places tokens exactly as
    # given (positions follow the mask) and keeps Transformer-XL memories contiguous.
    padded_ids = np.pad(ids, ((0, 0), (0, pad)))
    padded_mask = np.pad(mask, ((0, 0), (0, pad)))
    if not seq2seq:
        padded_ids, padded_mask = _left_aligned(padded_ids, padded_mask)
    graphdef, state = nnx.split(model)
    tokens = _generate(graphdef, state, jax.device_put(padded_ids.astype(np.int32)),
                       jnp.asarray(padded_mask), rng, filters, jnp.asarray(eos or [-1], jnp.int32),
                       jnp.int32(pad_token_id), max_new_tokens=max_new_tokens)
    # Assembled on the host: a device concatenate would compile once per prompt length.
    first = np.full((ids.shape[0], 1), config.decoder_start_token_id) if seq2seq else ids
    tokens = np.asarray(tokens)
    out = jax.device_put(np.concatenate([first, tokens], axis=1).astype(np.int32))
    if not return_lengths:
        return out
    return out, jax.device_put(lengths(tokens, eos, first.shape[1]))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate(graphdef, state, ids, mask, rng, filters, eos, pad_token_id, *,
              max_new_tokens: int) -> jax.Array:
    """The compiled program: prefill, then a while loop of cached single-token steps.
    Returns int32 [batch, max_new_tokens]."""
    model = nnx.merge(graphdef, state)
    batch = ids.shape[0]
    if isinstance(model, EncoderDecoder):
        encoded = model.encode(ids, attention_mask=mask)
        cache = model.init_cache(encoded, max_new_tokens + 1, attention_mask=mask)
        start = jnp.full((batch,), model.config.decoder_start_token_id, jnp.int32)
        head = None
        logits, cache = _step(model, head, start, cache)
    else:  # prompts arrive left-aligned: every row's last real token is the last column
        cache = model.init_cache(batch, min(ids.shape[1] + max_new_tokens, model.config.max_len))
        hidden, cache = model.hidden_states(ids, attention_mask=mask, cache=cache)
        head = model.output_weights()  # laid out once, outside the loop
        logits = model.logits(hidden[:, -1:], head)[:, 0]

    def choose(logits, i, done):
        key = None if rng is None else jax.random.fold_in(rng, i)
        token = sample_logits(logits, key, **filters)
        token = jnp.where(done, pad_token_id, token)
        return token, done | jnp.isin(token, eos)

    token, done = choose(logits, 0, jnp.zeros((batch,), bool))
    tokens = jnp.full((batch, max_new_tokens), pad_token_id, jnp.int32).at[:, 0].set(token)

    def unfinished(carry):
        i, *_, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def advance(carry):
        i, (weights, head), token, cache, tokens, done = carry
        logits, cache = _step(nnx.merge(graphdef, weights), head, token, cache)
        token, done = choose(logits, i, done)
        return i + 1, (weights, head), token, cache, tokens.at[:, i].set(token), done

    # The weights ride in the loop carry (unchanged) rather than being closed over: NNX modules
    # refuse values from an outer trace under a nested one (nnx.scan of stacked layers).
    carry = (jnp.int32(1), (state, head), token, cache, tokens, done)
    return jax.lax.while_loop(unfinished, advance, carry)[4]


def _step(model, head, token, cache):
    """One token per sequence through the cache: int [batch] -> logits [batch, vocab].
    head: a decoder's `output_weights()` (None for encoder–decoders)."""
    if isinstance(model, EncoderDecoder):
        logits, cache = model.decode(token[:, None], cache=cache)
        return logits[:, -1], cache
    hidden, cache = model.hidden_states(token[:, None], cache=cache)
    return model.logits(hidden[:, -1], head), cache


def _left_aligned(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Move each row's padding to the front, keeping the order of its real tokens."""
    order = np.argsort(mask, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(mask, order, axis=1)


def _check_sampling(temperature, top_k, top_p, rng) -> dict:
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
