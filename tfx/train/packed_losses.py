"""The losses of the objectives on packed rows (tfx.train.packed_feed): several documents or
examples per row, each a segment (ids 1, 2, ...; 0 = padding) with positions of its own. Each
loss is the unpacked one's (tfx.train.losses) with the segment ids and positions passed to the
model, and weights that count no padding and no target across a segment boundary.

`PACKED_LOSSES` maps each unpacked loss to its packed form (tfx.train.objectives picks it when
`data.packing` is on)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfx.train.losses import (
    _cross_entropy,
    causal_lm,
    masked_lm,
    sequence_to_sequence,
    supervised,
)
from tfx.train.masking import mask_tokens

__all__ = ["PACKED_LOSSES", "packed_causal_lm", "packed_masked_lm",
           "packed_sequence_to_sequence", "packed_supervised"]


def packed_causal_lm(model, batch: dict, rng: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """Next-token prediction within each document.

    batch: "tokens", "segment_ids", "positions" int [batch, seq + 1]. Inputs are [:, :-1];
    a target tokens[:, t + 1] counts only where it is in the same (non-zero) segment as its
    input tokens[:, t], so no target crosses a document boundary and padding is ignored.
    """
    del rng
    tokens, segments = batch["tokens"], batch["segment_ids"]
    logits = model(tokens[:, :-1], position_ids=batch["positions"][:, :-1],
                   segment_ids=segments[:, :-1])
    weights = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    return _cross_entropy(logits, tokens[:, 1:], weights)


def packed_supervised(model, batch: dict, rng: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """`supervised` on packed examples: batch "tokens", "loss_mask", "segment_ids",
    "positions" [batch, seq + 1]; a target counts where its loss_mask is True and it lies in
    its input's segment (an example's first token is never predicted from the one before)."""
    del rng
    tokens, segments = batch["tokens"], batch["segment_ids"]
    logits = model(tokens[:, :-1], position_ids=batch["positions"][:, :-1],
                   segment_ids=segments[:, :-1])
    weights = (segments[:, 1:] == segments[:, :-1]) & batch["loss_mask"][:, 1:]
    return _cross_entropy(logits, tokens[:, 1:], weights)


def packed_masked_lm(model, batch: dict, rng: jax.Array, *, mlm_probability: float = 0.15):
    """BERT masked LM on rows of `[CLS] text [SEP]` segments (as `masked_lm`); padding
    (segment 0) is never chosen. batch: "input_ids", "segment_ids", "positions" int
    [batch, seq]."""
    c, t = model.config, model.config.special_tokens
    specials = tuple(sorted({t.pad_id, t.cls_id, t.sep_id, t.mask_id}))
    inputs, chosen = mask_tokens(rng, batch["input_ids"], mask_token_id=t.mask_id,
                                 vocab_size=c.vocab_size, special_ids=specials,
                                 probability=mlm_probability)
    hidden = model(inputs, position_ids=batch["positions"], segment_ids=batch["segment_ids"])
    return _cross_entropy(model.mlm_logits(hidden), batch["input_ids"],
                          chosen & (batch["segment_ids"] > 0))


def packed_sequence_to_sequence(model, batch: dict, rng: jax.Array, *,
                                label_smoothing: float = 0.0):
    """Teacher forcing on rows of packed examples: example k of a row is source segment k
    and target segment k.

    batch: "input_ids", "segment_ids", "positions" int [batch, src]; "decoder_input_ids",
    "labels", "decoder_segment_ids", "decoder_positions" int [batch, tgt]. Every label of a
    non-zero segment counts. Metrics "exact" and "sequences" count examples (segments), not
    rows: an example is exact when all of its labels are predicted.
    """
    del rng
    segments = batch["decoder_segment_ids"]
    logits = model(batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"],
                   position_ids=batch["positions"], segment_ids=batch["segment_ids"],
                   decoder_position_ids=batch["decoder_positions"],
                   decoder_segment_ids=segments)
    weights = segments > 0
    total, count, metrics = _cross_entropy(logits, batch["labels"], weights, label_smoothing)
    wrong = (logits.argmax(-1) != batch["labels"]) & weights
    metrics.update(_exact_examples(wrong, segments))
    return total, count, metrics


def _exact_examples(wrong: jax.Array, segments: jax.Array) -> dict[str, jax.Array]:
    """{"exact": examples without a wrong label, "sequences": examples}, float32 sums over
    the segments (ids >= 1) of each row. wrong bool, segments int, both [batch, tgt]."""
    batch, length = segments.shape
    # One bucket per (row, segment id): segment ids are < length + 1.
    index = (jnp.arange(batch)[:, None] * (length + 1) + segments).reshape(-1)
    size = batch * (length + 1)
    tokens = jax.ops.segment_sum(jnp.ones(index.shape, jnp.int32), index, size)
    errors = jax.ops.segment_sum(wrong.reshape(-1).astype(jnp.int32), index, size)
    real = (tokens > 0) & (jnp.arange(size) % (length + 1) > 0)
    return {"exact": (real & (errors == 0)).sum().astype(jnp.float32),
            "sequences": real.sum().astype(jnp.float32)}


PACKED_LOSSES = {causal_lm: packed_causal_lm, masked_lm: packed_masked_lm,
                 sequence_to_sequence: packed_sequence_to_sequence,
                 supervised: packed_supervised}
