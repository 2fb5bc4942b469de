"""Bidirectional encoder: BERT, MiniLM and relatives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models import checks
from tfx.models.block import dtypes, model_norm
from tfx.models.config import EncoderConfig
from tfx.models.leading import leading_inputs
from tfx.models.stack import Embeddings, Stack
from tfx.nn import axes
from tfx.nn.linear import flat_linear
from tfx.nn.mlp import ACTIVATIONS
from tfx.ops.masks import padding_mask

__all__ = ["Encoder", "token_types_from_separators"]


@jax.jit
def token_types_from_separators(input_ids: jax.Array, sep_token_id: int) -> jax.Array:
    """BERT's segment ids for [CLS] A [SEP] B [SEP]: 0 through the first [SEP], 1 after it.

    Args:
      input_ids: int [batch, seq].
      sep_token_id: the [SEP] id (EncoderConfig.special_tokens.sep_id, 102 in BERT's
        vocabulary).
    Returns:
      int32 [batch, seq]. Padding after B gets 1 too; it is masked out anyway.
    """
    input_ids = checks.ids_array("input_ids", input_ids)
    is_sep = (input_ids == sep_token_id).astype(jnp.int32)
    seps_before = jnp.cumsum(is_sep, axis=1) - is_sep  # [SEP]s strictly before each token
    return (seps_before >= 1).astype(jnp.int32)


class Encoder(nnx.Module):
    """Word + position + token-type embeddings (each where the config has them) ->
    bidirectional layers; a [CLS] pooler and a masked-LM head tied to the word embeddings.

    Call it like Hugging Face's BertModel:
    `hidden = model(input_ids, attention_mask=mask, token_type_ids=types)`.
    """

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, EncoderConfig):
            raise TypeError(f"config must be an EncoderConfig, got {type(config).__name__}")
        c, kinds = config, dtypes(config)
        self.config = config
        self.embeddings = Embeddings(c, rngs=rngs)
        self.stack = Stack(c, causal=False, rngs=rngs)
        # d_model -> d_model: split the input dim only (FSDP), as the projections do.
        square = dict(kernel_metadata=axes.metadata(axes.EMBED, None), **kinds)
        self.pooler = flat_linear(c.d_model, c.d_model, rngs=rngs, **square)
        # Biased as the model's projections: BERT's head is, ModernBERT's is not.
        self.mlm_transform = flat_linear(c.d_model, c.d_model, use_bias=c.use_bias, rngs=rngs,
                                         **square)
        self.mlm_norm = model_norm(c, rngs=rngs)
        self.mlm_bias = nnx.Param(jnp.zeros((c.vocab_size,), kinds["param_dtype"]),
                                  **axes.metadata(axes.VOCAB))

    def __call__(self, input_ids: jax.Array, *, attention_mask: jax.Array | None = None,
                 token_type_ids: jax.Array | None = None,
                 position_ids: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Last hidden state.

        Args:
          input_ids: int [batch, seq], e.g. [CLS] A [SEP] B [SEP] and padding: ids in
            [0, vocab_size), batch and seq >= 1, seq <= max_len for position="learned". Every
            array argument is a jax or numpy array or a nested list.
          attention_mask: optional [batch, seq], 1/True for real tokens.
          token_type_ids: optional int [batch, seq] in [0, type_vocab_size): 0 through the
            first [SEP], 1 after (see `token_types_from_separators`); zeros when None, as in
            Hugging Face.
          position_ids: optional int [batch, seq] (default 0 .. seq - 1), within the learned
            table (< max_len) for position="learned".
          segment_ids: optional int [batch, seq] for packed sequences: a token attends only to
            tokens of its own segment (0 may mark padding, which then attends only padding).
            Give each document's positions in `position_ids`.
        Returns:
          float32 [batch, seq, d_model] (leading vectors' positions are dropped).
        Raises:
          ValueError: for values out of range, as `Decoder` (see `tfx.models.checks`).
        """
        c = self.config
        input_ids, attention_mask = checks.ids_and_mask(
            "input_ids", input_ids, "attention_mask", attention_mask, c.vocab_size)
        skip = self.embeddings.num_leading
        if token_type_ids is not None:
            if not c.type_vocab_size:
                raise ValueError("token_type_ids given to a model without token types "
                                 "(type_vocab_size 0): leave them out")
            token_type_ids = checks.int_array("token_type_ids", token_type_ids, "input_ids",
                                              input_ids)
            checks.in_range("token_type_ids", token_type_ids, 0, c.type_vocab_size,
                            "the token types, type_vocab_size")
        position_ids = checks.positions("position_ids", position_ids, "input_ids", input_ids, c,
                                        skip)
        segment_ids = checks.segment_ids("segment_ids", segment_ids, "input_ids", input_ids,
                                         skip)
        positions = jnp.arange(input_ids.shape[1]) if position_ids is None else position_ids
        if skip:
            positions, attention_mask, token_type_ids = leading_inputs(
                skip, c, input_ids, positions, attention_mask, token_type_ids)
        mask = None if attention_mask is None else padding_mask(attention_mask.astype(bool))
        x = self.embeddings(input_ids, positions, token_type_ids,
                            leading=self.embeddings.leading(input_ids.shape[0]))
        x = self.stack(x, positions=positions, mask=mask, segment_ids=segment_ids,
                       token_mask=attention_mask)
        return x[:, skip:].astype(jnp.float32)

    def pooled(self, hidden: jax.Array) -> jax.Array:
        """BERT's pooler: tanh(Linear(h[CLS])), [batch, d_model]."""
        return jnp.tanh(self.pooler(hidden[:, 0]))

    def mlm_logits(self, hidden: jax.Array) -> jax.Array:
        """Masked-LM head: Linear -> activation -> norm -> tied word embeddings + bias,
        float32 [batch, seq, vocab_size]."""
        h = self.mlm_norm(ACTIVATIONS[self.config.mlp.activation](self.mlm_transform(hidden)))
        logits = self.embeddings.tokens.attend(h) + self.mlm_bias[...]
        return logits.astype(jnp.float32)
