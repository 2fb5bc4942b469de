"""Causal language model: GPT-2, LLaMA, Mistral and their small relatives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models.block import dtypes
from tfx.models.config import DecoderConfig
from tfx.models.stack import Embeddings, Stack
from tfx.ops.masks import padding_mask

__all__ = ["Decoder"]


class Decoder(nnx.Module):
    """Token embeddings -> causal layers -> final norm -> output head (tied or not).

    Call it like Hugging Face's *ForCausalLM: `logits = model(input_ids, attention_mask=mask)`.
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = Embeddings(config, rngs=rngs)
        self.stack = Stack(config, causal=True, rngs=rngs)
        self.head = (None if config.tie_embeddings else nnx.Linear(
            config.d_model, config.vocab_size, use_bias=False, rngs=rngs, **dtypes(config)))

    def __call__(self, input_ids: jax.Array, *, attention_mask: jax.Array | None = None,
                 position_ids: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Next-token logits.

        Args:
          input_ids: int [batch, seq].
          attention_mask: optional [batch, seq], 1/True for real tokens, 0/False for padding.
          position_ids: optional int [batch, seq] (default 0 .. seq - 1).
          segment_ids: optional int [batch, seq] for packed sequences.
        Returns:
          float32 [batch, seq, vocab_size].
        """
        hidden = self.hidden_states(input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, segment_ids=segment_ids)
        return self.logits(hidden)

    def hidden_states(self, input_ids, *, attention_mask=None, position_ids=None,
                      segment_ids=None) -> jax.Array:
        """[batch, seq] -> the final-normalised hidden states [batch, seq, d_model]."""
        _check_ids(input_ids)
        positions = jnp.arange(input_ids.shape[1]) if position_ids is None else position_ids
        mask = None if attention_mask is None else padding_mask(attention_mask.astype(bool))
        x = self.embeddings(input_ids, positions)
        return self.stack(x, positions=positions, mask=mask, segment_ids=segment_ids)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[batch, seq, d_model] -> float32 [batch, seq, vocab_size]."""
        out = self.embeddings.tokens.attend(hidden) if self.head is None else self.head(hidden)
        return out.astype(jnp.float32)


def _check_ids(input_ids) -> None:
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be int [batch, seq], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
