"""Vectors that run before a call's tokens: how a model shifts positions and masks for them.

A model's embeddings may put `num_leading` (G) vectors [batch, G, d_model] before the token
embeddings (`Embeddings.leading`; none by default; learned vectors that a fine-tuning method
adds, or the embeddings of another modality). They sit at positions 0 .. G-1, every token
attends to them (their mask columns are True), and the tokens follow at positions G, G+1, ...;
decoders and encoders drop the G leading positions from their output, so logits and hidden
states keep the shape [batch, seq, ...] of the tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfx.models.config import TransformerConfig

__all__ = ["leading_inputs", "prepend"]


def leading_inputs(num_leading: int, config: TransformerConfig, input_ids: jax.Array,
                   positions: jax.Array, attention_mask: jax.Array | None = None,
                   token_type_ids: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Make room for `num_leading` vectors in front of a call's tokens.

    Args:
      num_leading: G >= 1.
      config: the model config (learned positions must hold G + seq).
      input_ids: int [batch, seq].
      positions: int [seq] or [batch, seq], the tokens' positions without the leading vectors.
      attention_mask: [batch, seq] (1/True = real token) or None.
      token_type_ids: int [batch, seq] or None; the leading vectors get type 0.
    Returns:
      positions [G + seq] or [batch, G + seq], and attention_mask and token_type_ids
      [batch, G + seq] (None stays None).
    """
    seq, g = input_ids.shape[1], num_leading
    if config.position == "learned" and g + seq > config.max_len:
        raise ValueError(f"the {g} leading vectors + input_ids ({seq} tokens) exceed the "
                         f"learned position table (max_len = {config.max_len})")
    head = jnp.arange(g, dtype=positions.dtype)
    if positions.ndim == 2:
        head = jnp.broadcast_to(head, (positions.shape[0], g))
    positions = jnp.concatenate([head, positions + g], axis=-1)
    return positions, prepend(attention_mask, g, True), prepend(token_type_ids, g, 0)


def prepend(columns: jax.Array | None, num_leading: int, value) -> jax.Array | None:
    """[batch, seq] -> [batch, num_leading + seq], the new columns filled with `value` (the
    leading vectors' entries of a mask or of token types); None stays None."""
    if columns is None:
        return None
    head = jnp.full((columns.shape[0], num_leading), value, columns.dtype)
    return jnp.concatenate([head, columns], axis=1)
