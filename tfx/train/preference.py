"""Preference tuning on (prompt, chosen, rejected) pairs: the DPO loss (Rafailov et al. 2023),
IPO (Azar et al. 2023) and the reference-free SimPO (Meng et al. 2024), as a loss of the house
protocol `(model, batch, rng) -> (loss_sum, count, metric_sums)`, and the batches they read.

The reference π_ref is the frozen starting model: with LoRA, the policy itself with its
adapters switched off (`tfx.peft.switch.adapters_off`, no second copy of the weights); with full
fine-tuning, log-probs the feed scored once with the starting model
(`PreferenceFeed.precompute_reference`), carried in the batch.

Metric sums (`dpo_loss`), each summed over pairs: divide by `"pairs"` for the means that TRL
logs as rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
logps/rejected: `METRICS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from tfx import names
from tfx.peft.switch import adapters_off
from tfx.train.sft_feed import (
    ExampleFeed,
    chat_tokenizer,
    data_source,
    split_examples,
    warn_skipped,
)

if TYPE_CHECKING:
    from tfx.train.config import Experiment
    from tfx.train.data import Tokenizer

__all__ = ["LOSS_TYPES", "METRICS", "PreferenceFeed", "completion_logps", "dpo_loss",
           "preference_loss", "reference_logps", "simpo_loss"]

LOSS_TYPES = names.PREFERENCE_LOSSES
METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy",
           "logps_chosen", "logps_rejected")
_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def completion_logps(logits: jax.Array, labels: jax.Array,
                     mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sum of log p(labels) where `mask`, and how many: logits [B, T, V] (any float dtype,
    normalised in float32), labels int [B, T], mask bool [B, T] -> (float32 [B], float32 [B])."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), -1)[..., 0]
    logps = picked - jax.nn.logsumexp(logits, axis=-1)
    mask = mask.astype(bool)
    return jnp.where(mask, logps, 0.0).sum(-1), mask.sum(-1).astype(jnp.float32)


def preference_loss(policy_chosen: jax.Array, policy_rejected: jax.Array,
                    ref_chosen: jax.Array, ref_rejected: jax.Array, *, beta: float,
                    loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                    chosen_count: jax.Array | None = None,
                    rejected_count: jax.Array | None = None):
    """Per-pair DPO or IPO losses from summed completion log-probs, each float [B].

    h = (log πθ(y_w) - log π_ref(y_w)) - (log πθ(y_l) - log π_ref(y_l)).
    "sigmoid" (DPO): -(1-ε)·log σ(βh) - ε·log σ(-βh), ε = label_smoothing: conservative DPO
      (Mitchell 2023), as TRL's CPO and pre-1.0 DPO have it; TRL 1.16's DPO "sigmoid" is ε = 0.
    "ipo": (h' - 1/(2β))², β being IPO's τ, with TRL's length normalisation: h' is h with each
      side's log-ratio divided by its number of completion tokens (chosen_count,
      rejected_count, float [B], required). TRL notes that the IPO authors confirmed this
      normalised form is the one of their reported results; summed, the loss would grow with
      the completion's length.

    Returns (losses, chosen_rewards, rejected_rewards), float32 [B]; rewards = β·(log πθ -
    log π_ref) of each side (summed, not normalised, as TRL logs them), without gradient.
    Raises ValueError naming a bad beta, loss_type, label_smoothing or missing count.
    """
    _check_beta_and_smoothing(beta, label_smoothing)
    if loss_type not in ("sigmoid", "ipo"):
        raise ValueError(f"loss_type must be 'sigmoid' or 'ipo' (SimPO, reference-free: "
                         f"simpo_loss), got {loss_type!r}")
    chosen_ratio = jnp.asarray(policy_chosen, jnp.float32) - ref_chosen
    rejected_ratio = jnp.asarray(policy_rejected, jnp.float32) - ref_rejected
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    else:
        if chosen_count is None or rejected_count is None:
            raise ValueError("chosen_count and rejected_count (completion tokens per pair) "
                             "are needed by loss_type 'ipo'")
        if label_smoothing:
            raise ValueError(f"label_smoothing applies to loss_type 'sigmoid' only, got "
                             f"{label_smoothing} with 'ipo'")
        h = (chosen_ratio / jnp.maximum(chosen_count, 1.0)
             - rejected_ratio / jnp.maximum(rejected_count, 1.0))
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    rewards = jax.lax.stop_gradient(beta * jnp.stack([chosen_ratio, rejected_ratio]))
    return losses, rewards[0], rewards[1]


def simpo_loss(chosen_mean_logps: jax.Array, rejected_mean_logps: jax.Array, *, beta: float,
               gamma: float, label_smoothing: float = 0.0):
    """SimPO, reference-free: -log σ(β·mean log πθ(y_w) - β·mean log πθ(y_l) - γ) per pair
    (with label_smoothing ε, the conservative form of `preference_loss`, as TRL's CPO has it).
    Inputs float [B], each the completion's average token log-prob. Returns (losses,
    chosen_rewards, rejected_rewards) float32 [B], rewards = β·mean log-prob without gradient.
    """
    _check_beta_and_smoothing(beta, label_smoothing)
    if not (np.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"gamma must be a finite number >= 0, got {gamma}")
    chosen = jnp.asarray(chosen_mean_logps, jnp.float32)
    rejected = jnp.asarray(rejected_mean_logps, jnp.float32)
    losses = _smoothed_sigmoid(beta * (chosen - rejected) - gamma, label_smoothing)
    rewards = jax.lax.stop_gradient(beta * jnp.stack([chosen, rejected]))
    return losses, rewards[0], rewards[1]


def dpo_loss(model, batch: dict, rng: jax.Array, *, beta: float = 0.1,
             loss_type: str = "sigmoid", simpo_gamma: float = 0.5,
             label_smoothing: float = 0.0) -> tuple[jax.Array, jax.Array, dict]:
    """The preference loss of a batch of pairs (objective dpo), summed over the pairs.

    batch: "chosen", "rejected" int [B, L + 1], rows prompt + completion + right padding;
      "chosen_mask", "rejected_mask" bool [B, L + 1], True on the completion tokens (the
      targets counted: inputs are rows[:, :-1], targets rows[:, 1:] where mask[:, 1:]).
      Optionally "ref_chosen_logps", "ref_rejected_logps" float32 [B]: the reference's summed
      log-probs (`PreferenceFeed.precompute_reference`), needed for a model without LoRA.
    Chosen and rejected rows run as one forward pass of 2B rows; the reference (unless given)
    is `adapters_off(model)` in eval mode, under stop_gradient. Right padding needs no mask:
    causal attention keeps it out of every real position. IPO and SimPO divide by the targets
    counted (TRL counts the mask before the shift: the same while rows start with a prompt).

    Returns (sum of the B per-pair losses, B as float32, metric sums over the pairs: METRICS
    and "pairs" = B).
    """
    del rng
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    pairs = batch["chosen"].shape[0]
    sums, counts = _pair_logps(model, batch)
    if loss_type == "simpo":
        losses, chosen_rewards, rejected_rewards = simpo_loss(
            *(sums / jnp.maximum(counts, 1.0)), beta=beta, gamma=simpo_gamma,
            label_smoothing=label_smoothing)
    else:
        losses, chosen_rewards, rejected_rewards = preference_loss(
            sums[0], sums[1], *_reference(model, batch), beta=beta, loss_type=loss_type,
            label_smoothing=label_smoothing, chosen_count=counts[0], rejected_count=counts[1])
    margin = chosen_rewards - rejected_rewards
    logps = jax.lax.stop_gradient(sums)
    metrics = {"rewards_chosen": chosen_rewards.sum(), "rewards_rejected": rejected_rewards.sum(),
               "rewards_margin": margin.sum(),
               "rewards_accuracy": (margin > 0).astype(jnp.float32).sum(),
               "logps_chosen": logps[0].sum(), "logps_rejected": logps[1].sum(),
               "pairs": jnp.float32(pairs)}
    return losses.sum(), jnp.float32(pairs), metrics


def reference_logps(model, batch: dict) -> tuple[jax.Array, jax.Array]:
    """The summed completion log-probs (float32 [B] each, chosen and rejected) of `batch` (as
    `dpo_loss` reads it) under `model`, without gradient: what `PreferenceFeed.
    precompute_reference` stores for full fine-tuning. Give it the starting model in eval mode
    (`model.eval()`: the reference has no dropout)."""
    sums, _ = _pair_logps(model, batch)
    sums = jax.lax.stop_gradient(sums)
    return sums[0], sums[1]


def _pair_logps(model, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(sums, counts), float32 [2, B] each (chosen, rejected), from one forward of 2B rows."""
    rows = jnp.concatenate([batch["chosen"], batch["rejected"]])
    masks = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]]).astype(bool)
    sums, counts = completion_logps(model(rows[:, :-1]), rows[:, 1:], masks[:, 1:])
    return sums.reshape(2, -1), counts.reshape(2, -1)


def _reference(model, batch: dict) -> tuple[jax.Array, jax.Array]:
    """π_ref's summed log-probs of the chosen and rejected completions, float32 [B] each."""
    if all(key in batch for key in _REF_KEYS):
        return tuple(jnp.asarray(batch[key], jnp.float32) for key in _REF_KEYS)
    try:
        reference = adapters_off(model)
    except ValueError as e:
        raise ValueError(f"dpo_loss needs the reference model's log-probs: with LoRA it switches "
                         f"the adapters off; otherwise give the batch {_REF_KEYS} "
                         f"(PreferenceFeed.precompute_reference). {e}") from e
    # The reference is the frozen starting model, so no dropout (TRL disables it too); the
    # eval mode is set on the copy adapters_off made, not on the policy.
    reference.eval()
    return reference_logps(reference, batch)


def _smoothed_sigmoid(logits: jax.Array, label_smoothing: float) -> jax.Array:
    """-(1-ε)·log σ(x) - ε·log σ(-x), from log σ (softplus) so that it stays finite."""
    loss = -jax.nn.log_sigmoid(logits)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * jax.nn.log_sigmoid(-logits)
    return loss


def _check_beta_and_smoothing(beta: float, label_smoothing: float) -> None:
    if not (np.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")


class PreferenceFeed(ExampleFeed):
    """Batches of preference pairs (objective dpo) from a JSONL file of {"prompt", "chosen",
    "rejected"} lines (`tfx.train.instructions.read_preference`): {"chosen", "rejected" int32,
    "chosen_mask", "rejected_mask" bool} [B, seq_len + 1] as `dpo_loss` reads them, rows
    right-padded with the tokenizer's pad id (its EOS, else 0); after `precompute_reference`
    also {"ref_chosen_logps", "ref_rejected_logps" float32 [B]}.

    Training batch k holds train.batch_size pairs drawn with `np.random.default_rng([seed,
    k])`; a data.val_fraction share of the pairs, chosen by a hash of their tokens
    (`tfx.train.sft_feed.split_examples`), is held out, and the validation batches are evenly
    spaced held-out pairs, the same on every call.
    """

    def __init__(self, experiment: Experiment):
        self.experiment = experiment
        self.tokenizer = self.tokenizer_of(experiment)
        train, val = split_examples(self._read(experiment), experiment.data.val_fraction)
        self.pairs = {"train": train, "val": val}
        self.reference: dict[str, np.ndarray] | None = None  # split -> float32 [pairs, 2]

    @classmethod
    def tokenizer_of(cls, experiment: Experiment) -> Tokenizer:
        """data.tokenizer, a transformers tokenizer folder (tfx.train.chat.ChatTokenizer),
        checked against the model."""
        return chat_tokenizer(experiment, "dpo")

    def _read(self, experiment: Experiment) -> list:
        """The pairs of data.source (prompt, chosen, rejected: int32 token arrays)."""
        from tfx.train.instructions import read_preference

        source = data_source(experiment, "dpo", '{"prompt", "chosen", "rejected"}')
        pairs, skipped = read_preference(source, self.tokenizer,
                                         max_tokens=experiment.train.seq_len + 1,
                                         skip_bad=experiment.data.skip_bad_lines)
        warn_skipped(skipped, source)
        return pairs

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens the model reads per training batch (chosen and rejected rows)."""
        t = self.experiment.train
        return 2 * t.batch_size * t.seq_len

    def _count(self, split: str) -> int:
        return len(self.pairs[split])

    def precompute_reference(self, score: Callable[[dict], tuple]) -> None:
        """Score every pair once with the reference (the frozen starting model, for full
        fine-tuning): `score(batch)` -> (chosen, rejected) summed log-probs, float [B] each,
        for a batch of train.batch_size rows (e.g. a jitted `reference_logps`). Every batch
        then carries them as "ref_chosen_logps" / "ref_rejected_logps"."""
        size = self.experiment.train.batch_size
        reference = {}
        for split, pairs in self.pairs.items():
            scores = np.zeros((len(pairs), 2), np.float32)
            for start in range(0, len(pairs), size):
                # The last batch wraps around to keep every batch one shape (one compile).
                picked = np.arange(start, start + size) % len(pairs)
                chosen, rejected = score(self._rows(split, picked))
                scores[picked] = np.stack([np.asarray(chosen), np.asarray(rejected)], -1)
            reference[split] = scores
        self.reference = reference

    def _batch(self, split: str, picked: np.ndarray) -> dict[str, np.ndarray]:
        batch = self._rows(split, picked)
        if self.reference is not None:
            scores = self.reference[split][picked]
            batch["ref_chosen_logps"], batch["ref_rejected_logps"] = scores[:, 0], scores[:, 1]
        return batch

    def _rows(self, split: str, picked: np.ndarray) -> dict[str, np.ndarray]:
        """prompt + completion rows of the pairs `picked`, padded to seq_len + 1, and the
        masks of their completion tokens."""
        width = self.experiment.train.seq_len + 1
        batch = {}
        for side in ("chosen", "rejected"):
            tokens = np.full((len(picked), width), self.pad_id, np.int32)
            mask = np.zeros((len(picked), width), bool)
            for row, index in enumerate(picked):
                pair = self.pairs[split][index]
                prompt, completion = pair.prompt, getattr(pair, side)
                end = len(prompt) + len(completion)
                if end > width:
                    raise ValueError(f"a pair's prompt and {side} completion have {end} tokens, "
                                     f"more than train.seq_len + 1 = {width}")
                tokens[row, :len(prompt)], tokens[row, len(prompt):end] = prompt, completion
                mask[row, len(prompt):end] = True
            batch[side], batch[f"{side}_mask"] = tokens, mask
        return batch
