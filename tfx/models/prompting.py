"""How a model runs a soft prompt (prompt tuning, `tfx.peft.SoftPrompt`).

A model's `prompt` attribute is None, or a module with `num_tokens` (G) whose call
`prompt(batch)` gives the vectors [batch, G, d_model]. They go before the token embeddings at
positions 0 .. G-1, are attended by every token (their mask columns are True), and the tokens
follow at positions G, G+1, ...; decoders and encoders drop the G prompt positions from their
output, so logits and hidden states keep the shape [batch, seq, ...] of the tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tfx.models.config import TransformerConfig

__all__ = ["PromptInputs", "prepend", "prompt_inputs"]


class PromptInputs(NamedTuple):
    """The inputs of the layers with the prompt in front: vectors [batch, G, d_model] for
    `Embeddings(prompt=)`, positions [G + seq] or [batch, G + seq], and attention_mask /
    token_type_ids [batch, G + seq] (None stays None)."""

    vectors: jax.Array
    positions: jax.Array
    attention_mask: jax.Array | None
    token_type_ids: jax.Array | None


def prompt_inputs(prompt, config: TransformerConfig, input_ids: jax.Array,
                  positions: jax.Array, attention_mask: jax.Array | None = None,
                  token_type_ids: jax.Array | None = None) -> PromptInputs:
    """Put a model's soft prompt in front of a call's tokens.

    Args:
      prompt: the model's prompt module (see the module docstring).
      config: the model config (learned positions must hold G + seq).
      input_ids: int [batch, seq].
      positions: int [seq] or [batch, seq], the tokens' positions without the prompt.
      attention_mask: [batch, seq] (1/True = real token) or None.
      token_type_ids: int [batch, seq] or None; the prompt gets type 0.
    """
    batch, seq = input_ids.shape
    g = prompt.num_tokens
    if config.position == "learned" and g + seq > config.max_len:
        raise ValueError(f"the soft prompt ({g} tokens) + input_ids ({seq} tokens) exceed the "
                         f"learned position table (max_len = {config.max_len})")
    head = jnp.arange(g, dtype=positions.dtype)
    if positions.ndim == 2:
        head = jnp.broadcast_to(head, (positions.shape[0], g))
    positions = jnp.concatenate([head, positions + g], axis=-1)
    return PromptInputs(prompt(batch), positions, prepend(attention_mask, g, True),
                        prepend(token_type_ids, g, 0))


def prepend(columns: jax.Array | None, num_tokens: int, value) -> jax.Array | None:
    """[batch, seq] -> [batch, num_tokens + seq], the new columns filled with `value` (the
    prompt's entries of a mask or of token types); None stays None."""
    if columns is None:
        return None
    head = jnp.full((columns.shape[0], num_tokens), value, columns.dtype)
    return jnp.concatenate([head, columns], axis=1)
