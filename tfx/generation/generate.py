"""`tfx.generate`: sampling or greedy decoding with a KV cache, compiled once.

One call is one compiled program: prefill the whole prompt in a single model call, then a
`lax.while_loop` that feeds one token per step through the cache until `max_new_tokens` or until
every sequence has produced EOS (or completed a stop sequence). It is compiled once per (model
structure, batch, prompt-length bucket, max_new_tokens, which filters and processors are on);
the sampling values (temperature, top_k, top_p), the processors' values
(`tfx.generation.processors`) and the prompt itself are ordinary inputs, so changing them does
not recompile.

The arguments a call leaves unset come from the model's `generation_config`
(`tfx.generation.config`): a checkpoint loaded with `tfx.hf.load` decodes as transformers'
`generate` decodes it, with its EOS ids, pad id and sampling settings.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.generation._inputs import (
    bucket_length,
    decoder_prompt,
    fits,
    integer,
    outside_jit,
    prompt_and_mask,
    sampling_filters,
    sampling_key,
    source_fits,
    special_ids,
)
from tfx.generation._steps import prefill, step
from tfx.generation.config import generation_config_of
from tfx.generation.processors import LogitsProcessors, logits_processors
from tfx.models.decoder import Decoder
from tfx.models.encoder_decoder import EncoderDecoder
from tfx.ops.sampling import sample_logits

__all__ = ["bucket_length", "generate"]

NO_PROCESSORS = LogitsProcessors()


def generate(model: Decoder | EncoderDecoder, input_ids, *, max_new_tokens: int | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, rng: jax.Array | None = None, attention_mask=None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             bucket: bool = True, return_lengths: bool = False,
             repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
             min_new_tokens: int | None = None,
             bad_words_ids: Sequence[Sequence[int]] | None = None,
             stop_sequences: Sequence[Sequence[int]] | None = None):
    """Continue prompts with a KV cache.

    Every argument left None is taken from `model.generation_config` (a
    `tfx.generation.GenerationConfig`: what `tfx.hf.load` reads from the checkpoint's
    generation_config.json), as transformers' `generate` takes it from the model's; a model
    without one decodes greedily with no EOS. Explicit values win.

    Args:
      model: a `tfx.models.Decoder` (GPT-2, LLaMA, Mistral...) or `EncoderDecoder` (T5).
      input_ids: int [batch, prompt_len] (an array or nested lists), ids in [0, vocab_size),
        batch and prompt_len >= 1: the prompts (decoders) or the source (encoder–decoders).
      max_new_tokens: tokens to generate per sequence (int >= 1). Default: the config's
        max_new_tokens, else its max_length minus prompt_len (minus the start token for an
        encoder–decoder); one of them must be set.
      temperature: 0.0 is greedy; > 0 (finite) samples from softmax(logits / temperature).
        Default: the config's temperature when it says do_sample, else 0.0 (greedy).
      top_k: keep the k most likely tokens (int >= 1; k >= vocab_size keeps all; 0 keeps all,
        as in transformers, switching off the config's). Default: the config's.
      top_p: nucleus sampling: keep the most likely tokens whose probability reaches top_p, in
        (0, 1] (1 keeps all). Default: the config's.
      rng: a jax.random key for sampling. Default: jax.random.key(0), so that the same call
        gives the same tokens (transformers draws from torch's global generator instead): pass
        keys of your own for different samples.
      attention_mask: [batch, prompt_len], 1 for real tokens and 0 for padding (left or right).
      eos_token_id: token id(s) that end a sequence; after it a sequence emits `pad_token_id`.
        Default: the config's (less ids past the vocabulary, never produced); [] for none.
      pad_token_id: filler after EOS, in [0, vocab_size). Default: the config's, else the
        model config's `embeddings.pad_id` (`tfx.hf.load` sets it from config.json's
        `pad_token_id`: T5's 0), else the first eos_token_id (else 0).
      bucket: pad the prompt (masked) to a power-of-two length so that nearby prompt lengths
        share one compiled program.
      return_lengths: also return each row's length (the numpy convention of
        `return_index=`-style flags: the result becomes a tuple).
      repetition_penalty: a logits processor with transformers' name and meaning, as the
        next three, applied in its order before the temperature / top-k / top-p
        (`tfx.generation.processors`). They see a row's real tokens only: its prompt without
        padding (for an encoder–decoder, the decoder start token), then the new tokens.
        Default: the config's (1.0 switches it off).
      no_repeat_ngram_size: a logits processor, as repetition_penalty (0 switches the
        config's off).
      min_new_tokens: a logits processor, as repetition_penalty; needs eos_token_id.
      bad_words_ids: a logits processor, as repetition_penalty.
      stop_sequences: token id sequences; a row whose newest tokens complete one ends there,
        as with EOS (the sequence stays, `pad_token_id` follows). It may begin in the prompt.
    Returns:
      int32 [batch, prompt_len + max_new_tokens] for decoders (the prompt as given, padding
      included, then the new tokens), or [batch, 1 + max_new_tokens] for encoder–decoders
      (decoder start token, then new tokens). With return_lengths, `(tokens, lengths)`:
      lengths int32 [batch], the columns before the new tokens (all prompt_len columns of a
      decoder's prompt, left or right padding included; the start token of an encoder–decoder)
      plus the new tokens up to and including the row's first EOS (all max_new_tokens without
      one; up to a stop sequence's end likewise), so `tokens[i, :lengths[i]]` is row i
      without its filler; subtract the prompt
      mask's zeros for a count of real tokens.
    Raises:
      ValueError: before anything compiles, for an argument out of range (numbers may be
        Python or numpy scalars; NaN and infinities are refused), no max_new_tokens (neither
        given nor in the config), or a prompt + max_new_tokens longer than the model's max_len
        (its learned positions or its cache).
      TypeError: for a model of another kind, or when called under jax.jit / nnx.jit (generate
        compiles its own loop: call it outside).
    """
    if not isinstance(model, Decoder | EncoderDecoder):
        raise TypeError(f"model must be a tfx Decoder or EncoderDecoder, got "
                        f"{type(model).__name__}")
    outside_jit("tfx.generate", nnx.state(model), input_ids, attention_mask, rng)
    defaults = generation_config_of(model)
    config = model.config
    ids, mask = prompt_and_mask(input_ids, attention_mask, config.vocab_size)
    seq2seq = isinstance(model, EncoderDecoder)
    max_new_tokens = integer("max_new_tokens", defaults.new_tokens(
        max_new_tokens, 1 if seq2seq else ids.shape[1]))
    filters = sampling_filters(*defaults.sampling(temperature, top_k, top_p))
    rng = sampling_key(rng, filters)
    eos, pad_token_id = special_ids(config, defaults, eos_token_id, pad_token_id)
    unset = defaults.fill(repetition_penalty=repetition_penalty,
                          no_repeat_ngram_size=no_repeat_ngram_size)
    processors = logits_processors(
        config.vocab_size, eos, repetition_penalty=unset["repetition_penalty"],
        no_repeat_ngram_size=unset["no_repeat_ngram_size"], min_new_tokens=min_new_tokens,
        bad_words_ids=bad_words_ids, stop_sequences=stop_sequences)
    if seq2seq:
        source_fits(config, ids.shape[1])
        fits(1, max_new_tokens, config.max_len)
        # An encoder's source keeps its layout (absolute positions see real tokens where they
        # were), padded on the right.
        pad = (bucket_length(ids.shape[1], config.max_len) if bucket else ids.shape[1]) - \
            ids.shape[1]
        padded_ids, padded_mask = (np.pad(x, ((0, 0), (0, pad))) for x in (ids, mask))
    else:
        padded_ids, padded_mask = decoder_prompt(config.max_len, ids, mask, max_new_tokens,
                                                 bucket=bucket)
    graphdef, state = nnx.split(model)
    tokens, ends = _generate(graphdef, state, jax.device_put(padded_ids.astype(np.int32)),
                             jnp.asarray(padded_mask), rng, filters,
                             jnp.asarray(eos or [-1], jnp.int32), jnp.int32(pad_token_id),
                             processors, max_new_tokens=max_new_tokens)
    # Assembled on the host: a device concatenate would compile once per prompt length.
    first = np.full((ids.shape[0], 1), config.decoder_start_token_id) if seq2seq else ids
    out = jax.device_put(np.concatenate([first, np.asarray(tokens)], axis=1).astype(np.int32))
    if not return_lengths:
        return out
    return out, jax.device_put((first.shape[1] + np.asarray(ends)).astype(np.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate(graphdef, state, ids, mask, rng, filters, eos, pad_token_id,
              processors: LogitsProcessors = NO_PROCESSORS, *, max_new_tokens: int):
    """The compiled program: prefill, then a while loop of cached single-token steps.
    Returns int32 [batch, max_new_tokens] tokens and int32 [batch] the new tokens of each row
    up to and including the one that ended it (EOS or a stop sequence's last; all without)."""
    model = nnx.merge(graphdef, state)
    logits, cache, head, prompt, prompt_valid = prefill(model, ids, mask, copies=1,
                                                        max_new_tokens=max_new_tokens)
    batch, width = prompt.shape
    new = jnp.arange(max_new_tokens)

    def choose(logits, i, tokens, done, ends):
        history = jnp.concatenate([prompt, tokens], axis=1)
        logits = processors(logits, history, jnp.concatenate(
            [prompt_valid, jnp.broadcast_to(new < i, tokens.shape)], axis=1), width + i, i)
        key = None if rng is None else jax.random.fold_in(rng, i)
        token = jnp.where(done, pad_token_id, sample_logits(logits, key, **filters))
        tokens = tokens.at[:, i].set(token)
        stopped = processors.stopped(
            jnp.concatenate([prompt, tokens], axis=1),
            jnp.concatenate([prompt_valid, jnp.broadcast_to(new <= i, tokens.shape)], axis=1),
            width + i + 1)
        ended = ~done & (jnp.isin(token, eos) | stopped)
        return token, tokens, done | ended, jnp.where(ended, i + 1, ends)

    tokens = jnp.full((batch, max_new_tokens), pad_token_id, jnp.int32)
    start = choose(logits, 0, tokens, jnp.zeros((batch,), bool),
                   jnp.full((batch,), max_new_tokens, jnp.int32))

    def unfinished(carry):
        i, *_, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def advance(carry):
        i, (weights, head), token, cache, tokens, done, ends = carry
        logits, cache = step(nnx.merge(graphdef, weights), head, token, cache)
        token, tokens, done, ends = choose(logits, i, tokens, done, ends)
        return i + 1, (weights, head), token, cache, tokens, done, ends

    # The weights ride in the loop carry (unchanged) rather than being closed over: NNX modules
    # refuse values from an outer trace under a nested one (nnx.scan of stacked layers).
    carry = (jnp.int32(1), (state, head), start[0], cache, *start[1:])
    carry = jax.lax.while_loop(unfinished, advance, carry)
    return carry[4], carry[6]
