"""The losses of the training objectives (tfx.train.objectives): causal LM, supervised
fine-tuning (causal LM on the answers only), masked LM (BERT) and sequence-to-sequence with
teacher forcing. Each is `(model, batch, rng) -> (loss summed over
its targets, number of targets, metric sums)`, so micro-batches of gradient accumulation add up
exactly to the full batch's mean."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from tfx.train.masking import mask_tokens

__all__ = ["causal_lm", "masked_lm", "sequence_to_sequence", "supervised"]


def causal_lm(model, batch: dict, rng: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """Next-token prediction. batch["tokens"]: int [batch, seq + 1]; inputs are tokens[:, :-1]
    and targets tokens[:, 1:]."""
    del rng
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return _cross_entropy(logits, tokens[:, 1:], jnp.ones(tokens[:, 1:].shape, bool))


def supervised(model, batch: dict, rng: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """Next-token prediction counted only on the answers (SFT's completion-only loss).

    batch: "tokens" int [batch, seq + 1] (prompt, answer, then padding on the right: causal
    attention keeps padding out of every real position), "loss_mask" bool [batch, seq + 1],
    True on the tokens to predict (completion or assistant tokens); the target
    tokens[:, t + 1] counts where loss_mask[:, t + 1].
    """
    del rng
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return _cross_entropy(logits, tokens[:, 1:], batch["loss_mask"][:, 1:])


def masked_lm(model, batch: dict, rng: jax.Array, *, mlm_probability: float = 0.15):
    """BERT masked LM: 15% of the real, non-special tokens are chosen (80% -> [MASK], 10% ->
    random, 10% kept) and predicted. batch: "input_ids" int [batch, seq], "attention_mask"
    bool [batch, seq]."""
    c, t = model.config, model.config.special_tokens
    specials = tuple(sorted({t.pad_id, t.cls_id, t.sep_id, t.mask_id}))
    inputs, chosen = mask_tokens(rng, batch["input_ids"], mask_token_id=t.mask_id,
                                 vocab_size=c.vocab_size, special_ids=specials,
                                 probability=mlm_probability)
    hidden = model(inputs, attention_mask=batch["attention_mask"])
    return _cross_entropy(model.mlm_logits(hidden), batch["input_ids"],
                          chosen & batch["attention_mask"].astype(bool))


def sequence_to_sequence(model, batch: dict, rng: jax.Array, *, label_smoothing: float = 0.0):
    """Teacher forcing: the decoder reads decoder_input_ids ([BOS] + target) and predicts
    labels (target + [EOS]) where label_mask is True; optional label smoothing.

    batch: "input_ids", "attention_mask" [batch, src]; "decoder_input_ids", "labels",
    "label_mask" [batch, tgt]. Metrics add "exact": sequences whose every label is predicted.
    """
    del rng
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=batch["decoder_input_ids"])
    weights = batch["label_mask"].astype(bool)
    total, count, metrics = _cross_entropy(logits, batch["labels"], weights, label_smoothing)
    correct = (logits.argmax(-1) == batch["labels"]) | ~weights
    metrics["exact"] = correct.all(-1).sum().astype(jnp.float32)
    metrics["sequences"] = jnp.float32(weights.shape[0])
    return total, count, metrics


def _cross_entropy(logits, labels, weights, label_smoothing: float = 0.0):
    """Sum of per-token cross-entropy over `weights`, its count, and accuracy sums.
    logits float32 [batch, seq, vocab]; labels int [batch, seq]; weights bool [batch, seq]."""
    logits = logits.astype(jnp.float32)
    if label_smoothing:
        targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
        losses = optax.softmax_cross_entropy(logits, targets)
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    weights = weights.astype(jnp.float32)
    correct = (logits.argmax(-1) == labels).astype(jnp.float32) * weights
    count = weights.sum()
    return (losses * weights).sum(), count, {"correct": correct.sum(), "targets": count}

