"""The two ways a decoding loop talks to a model, shared by `generate` and `beam_search`:
`prefill` starts it (a decoder reads its prompt, an encoder–decoder encodes its source and
decodes the start token), `step` feeds one token per row through the cache. Both return the
next token's logits, so that a loop's first choice and every later one look the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfx.models.encoder_decoder import EncoderDecoder

__all__ = ["prefill", "step"]


def prefill(model, ids: jax.Array, mask: jax.Array, *, copies: int, max_new_tokens: int):
    """Run the inputs once and lay the state out for `copies` rows per input (beams).

    Args:
      model: a tfx Decoder or EncoderDecoder.
      ids: int32 [batch, length]: a decoder's prompts, left-aligned (every row's last real token
        in the last column), or an encoder–decoder's sources.
      mask: bool [batch, length], False for padding.
    Returns:
      (logits float32 [batch * copies, vocab] for the first new token, the cache of those rows
      (row b * copies + k is copy k of input b), the decoder's output head for `step` (None for
      an encoder–decoder), and the tokens the new ones follow with their mask, int32 / bool
      [batch * copies, width]: the prompt, or the decoder start token).
    """
    batch = ids.shape[0]
    rows = jnp.repeat(jnp.arange(batch), copies)
    if isinstance(model, EncoderDecoder):
        encoded = model.encode(ids, attention_mask=mask)
        cache = model.init_cache(encoded, max_new_tokens, attention_mask=mask)
        cache = cache if copies == 1 else cache.take(rows)
        start = jnp.full((batch * copies, 1), model.config.decoder_start_token_id, jnp.int32)
        logits, cache = step(model, None, start[:, 0], cache)
        return logits, cache, None, start, jnp.ones(start.shape, bool)
    cache = model.init_cache(batch, min(ids.shape[1] + max_new_tokens, model.config.max_len))
    hidden, cache = model.hidden_states(ids, attention_mask=mask, cache=cache)
    head = model.output_weights()  # laid out once, outside the loop
    logits = model.logits(hidden[:, -1:], head)[:, 0]
    if copies == 1:
        return logits, cache, head, ids, mask
    return logits[rows], cache.take(rows), head, ids[rows], mask[rows]


def step(model, head, token: jax.Array, cache):
    """One token per row through the cache: int [rows] -> (logits float32 [rows, vocab], the
    cache). head: a decoder's `output_weights()` (None for encoder–decoders)."""
    if isinstance(model, EncoderDecoder):
        logits, cache = model.decode(token[:, None], cache=cache)
        return logits[:, -1], cache
    hidden, cache = model.hidden_states(token[:, None], cache=cache)
    return model.logits(hidden[:, -1], head), cache
