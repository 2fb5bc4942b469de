"""A self-speculative draft: the target's own first layers, its final norm and its head
(early exit, as in LayerSkip, Elhoushi et al. 2024), for `speculative_generate` without a
second trained model."""

from __future__ import annotations

import jax
from flax import nnx

from tfx.generation._inputs import integer
from tfx.models.config import DecoderConfig
from tfx.models.decoder import Decoder

__all__ = ["early_exit_draft"]


def early_exit_draft(model: Decoder, num_layers: int) -> Decoder:
    """A Decoder made of `model`'s first `num_layers` layers, then its final norm and head.

    The embeddings, final norm and head are `model`'s own modules (shared: an update of one is
    an update of the other). Unrolled layers are shared too; scanned (stacked) layers
    (`compute.scan_layers`) hold their weights in one array per parameter, so the draft gets a
    copy of the first `num_layers` slices (num_layers / model's layers of the layer weights in
    extra memory).

    Args:
      model: a `tfx.models.Decoder`.
      num_layers: int in [1, model.config.num_layers].
    Returns:
      a Decoder whose config is `model.config` with num_layers (and per-layer attention
      layer_types) cut to the first `num_layers`, in the mode (train / eval) of `model`.
    """
    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a tfx Decoder, got {type(model).__name__}")
    total = model.config.num_layers
    num_layers = integer("num_layers", num_layers)
    if num_layers > total:
        raise ValueError(f"num_layers must be in [1, {total}] (the model's layers), got "
                         f"{num_layers}")
    config = _first_layers(model.config, num_layers)
    draft = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))  # no weights drawn
    draft.embeddings, draft.head = model.embeddings, model.head
    stack = draft.stack
    stack.relative_bias, stack.final_norm = model.stack.relative_bias, model.stack.final_norm
    stack.dropout = model.stack.dropout
    if model.stack.scan_layers:
        graphdef, state = nnx.split(model.stack.layers)
        stack.layers = nnx.merge(graphdef, jax.tree.map(lambda x: x[:num_layers], state))
    else:
        stack.layers = nnx.List(model.stack.layers[:num_layers])
    return draft


def _first_layers(config: DecoderConfig, num_layers: int) -> DecoderConfig:
    """`config` for its first `num_layers` layers."""
    types = config.attention.layer_types
    if types is None:
        return config.replace(num_layers=num_layers)
    return config.replace(num_layers=num_layers, attention={"layer_types": types[:num_layers]})
