"""The objectives' losses against losses written out with numpy from the same logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_cases import tiny

from tfx.models import create
from tfx.train.losses import causal_lm, masked_lm, sequence_to_sequence


def _log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _model(name):
    return create(tiny(name).model, rngs=nnx.Rngs(0))


def test_causal_lm_is_mean_next_token_cross_entropy():
    model = _model("gpt_char")
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, 256)
    total, count, metrics = causal_lm(model, {"tokens": tokens}, jax.random.key(0))
    logp = _log_softmax(model(tokens[:, :-1]))
    targets = np.asarray(tokens[:, 1:])
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    assert count == 3 * 8
    np.testing.assert_allclose(total / count, nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["correct"], (logp.argmax(-1) == targets).sum())


def test_masked_lm_counts_only_chosen_real_tokens():
    model = _model("bert_mlm")
    c = model.config
    ids = np.random.default_rng(2).integers(0, 256, (4, 24)).astype(np.int32)
    t = c.special_tokens
    ids[:, 0], ids[:, 20], ids[:, 21:] = t.cls_id, t.sep_id, t.pad_id
    mask = ids != t.pad_id
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}
    total, count, _ = masked_lm(model, batch, jax.random.key(3), mlm_probability=0.5)
    # Recompute with the same masking draw: the chosen positions are where the loss counts.
    from tfx.train.masking import mask_tokens

    specials = tuple(sorted({t.pad_id, t.cls_id, t.sep_id, t.mask_id}))
    inputs, chosen = mask_tokens(jax.random.key(3), batch["input_ids"],
                                 mask_token_id=c.special_tokens.mask_id, vocab_size=c.vocab_size,
                                 special_ids=specials, probability=0.5)
    chosen = np.asarray(chosen)
    assert not chosen[~mask].any() and not chosen[:, 0].any() and not chosen[:, 20].any()
    assert count == chosen.sum() > 0
    logp = _log_softmax(model.mlm_logits(model(inputs, attention_mask=batch["attention_mask"])))
    nll = -np.take_along_axis(logp, ids[..., None], -1)[..., 0]
    np.testing.assert_allclose(total, nll[chosen].sum(), rtol=1e-5)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_sequence_to_sequence_label_smoothing(smoothing):
    model = _model("seq2seq_reverse")
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 256, (2, 6)), "attention_mask": np.ones((2, 6), bool),
             "decoder_input_ids": rng.integers(0, 256, (2, 5)),
             "labels": rng.integers(0, 256, (2, 5)),
             "label_mask": np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)}
    batch = jax.tree.map(jnp.asarray, batch)
    total, count, metrics = sequence_to_sequence(model, batch, jax.random.key(0),
                                                 label_smoothing=smoothing)
    logp = _log_softmax(model(batch["input_ids"], attention_mask=batch["attention_mask"],
                              decoder_input_ids=batch["decoder_input_ids"]))
    vocab = logp.shape[-1]
    target = np.eye(vocab)[np.asarray(batch["labels"])] * (1 - smoothing) + smoothing / vocab
    per_token = -(target * logp).sum(-1)
    weights = np.asarray(batch["label_mask"])
    assert count == 8
    np.testing.assert_allclose(total, per_token[weights].sum(), rtol=1e-5)
    assert metrics["sequences"] == 2 and 0 <= metrics["exact"] <= 2
