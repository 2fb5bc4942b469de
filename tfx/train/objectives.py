"""Training objectives as objects: what a run trains for, with its model family, tokenizer,
batches and loss in one place.

    objective = get_objective(experiment.objective)   # causal_lm, mlm, seq2seq, sft, dpo
    objective.model_config      # DecoderConfig, EncoderConfig, EncoderDecoderConfig
    objective.tokenizer(experiment), objective.batches(experiment), objective.loss(experiment)
    objective.can_sample        # its model continues text (`tfx sample`, `tfx.generate`)

An experiment names its objective (`Experiment.objective`, the name stored in a run's
config.json and given on the command line, one of `tfx.names.OBJECTIVES`); `OBJECTIVES` maps
each name to its object once. A new objective is its name in tfx.names, one more class here and
its entry in OBJECTIVES (in the same order, which tests/train/test_config_literals.py checks),
never a branch elsewhere.

This module imports no jax (the command line validates configs without it): the feeds and
losses, which need numpy and jax, are imported when asked for. The loss functions themselves
live in `tfx.train.losses` (and import from here too, lazily).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from tfx.models.config import DecoderConfig, EncoderConfig, EncoderDecoderConfig

if TYPE_CHECKING:
    from tfx.train.config import Experiment
    from tfx.train.data import Tokenizer
    from tfx.train.feed import TaskFeed, TextFeed

__all__ = ["OBJECTIVES", "CausalLM", "MaskedLM", "Objective", "PreferenceTuning",
           "SequenceToSequence", "SupervisedFineTuning", "get_objective"]

# (model, batch, rng) -> (loss summed over the targets, number of targets, metric sums)
Loss = Callable


class Objective(abc.ABC):
    """What a run trains for. A kind is a frozen dataclass subclass giving its `name` (as
    stored and named on the command line), `model_config` (the config class of the model
    family it trains), `can_sample` (whether the model continues text) and its feed and
    loss."""

    name: ClassVar[str]
    model_config: ClassVar[type]
    can_sample: ClassVar[bool] = False

    def check(self, experiment: Experiment) -> None:
        """Refuse an experiment this objective cannot train: a model of another family
        (TypeError naming both)."""
        if type(experiment.model) is not self.model_config:
            raise TypeError(f"objective {self.name!r} needs model: "
                            f"{self.model_config.__name__}, got {type(experiment.model).__name__}")

    def tokenizer(self, experiment: Experiment) -> Tokenizer:
        """The tokenizer the model reads, checked against the model config (ValueError)."""
        return self._chosen_feed(experiment).tokenizer_of(experiment)

    def batches(self, experiment: Experiment) -> TextFeed | TaskFeed:
        """The run's feed (`train(step)`, `validation()`, `tokens_per_batch`, `tokenizer`);
        reads the data, so a bad path fails here."""
        return self._chosen_feed(experiment)(experiment)

    def loss(self, experiment: Experiment) -> Loss:
        """`(model, batch, rng) -> (loss_sum, count, metric_sums)` with the experiment's
        settings of this loss (tfx.train.losses; tfx.train.packed_losses with data.packing)."""
        loss = self._loss()
        if experiment.data.packing:
            from tfx.train.packed_losses import PACKED_LOSSES

            loss = PACKED_LOSSES[loss]
        settings = self._loss_settings(experiment)
        return functools.partial(loss, **settings) if settings else loss

    def _chosen_feed(self, experiment: Experiment) -> type[TextFeed | TaskFeed]:
        """The feed class, or its packed form (tfx.train.packed_feed) with data.packing: the
        one place where packing picks the batches (and, in `loss`, the loss)."""
        if experiment.data.packing:
            from tfx.train.packed_feed import PACKED_FEEDS

            return PACKED_FEEDS[self._feed()]
        return self._feed()

    def prepare(self, feed, model) -> None:  # noqa: B027 (most objectives need nothing)
        """Ready `feed` with what it needs from the starting `model` (nothing, for most)."""

    @abc.abstractmethod
    def _loss(self) -> Loss:
        """The loss function (tfx.train.losses), imported when asked for: it needs jax."""

    def _loss_settings(self, experiment: Experiment) -> dict:
        """The experiment's keyword arguments of the loss."""
        return {}

    @abc.abstractmethod
    def _feed(self) -> type[TextFeed | TaskFeed]:
        """The feed class (tfx.train.feed), imported when asked for: it needs numpy."""


@dataclasses.dataclass(frozen=True)
class CausalLM(Objective):
    """Next-token prediction on text (GPT): batches of corpus windows."""

    name: ClassVar[str] = "causal_lm"
    model_config: ClassVar[type] = DecoderConfig
    can_sample: ClassVar[bool] = True

    def _loss(self) -> Loss:
        from tfx.train.losses import causal_lm

        return causal_lm

    def _feed(self) -> type[TextFeed | TaskFeed]:
        from tfx.train.feed import TextFeed

        return TextFeed


@dataclasses.dataclass(frozen=True)
class MaskedLM(Objective):
    """BERT's masked LM on text: experiment.mlm_probability of the tokens are predicted."""

    name: ClassVar[str] = "mlm"
    model_config: ClassVar[type] = EncoderConfig

    def _loss(self) -> Loss:
        from tfx.train.losses import masked_lm

        return masked_lm

    def _loss_settings(self, experiment: Experiment) -> dict:
        return {"mlm_probability": experiment.mlm_probability}

    def _feed(self) -> type[TextFeed | TaskFeed]:
        from tfx.train.feed import MaskedFeed

        return MaskedFeed


@dataclasses.dataclass(frozen=True)
class SequenceToSequence(Objective):
    """Teacher-forced encoder-decoder training on a synthetic task (data.task), with
    experiment.label_smoothing."""

    name: ClassVar[str] = "seq2seq"
    model_config: ClassVar[type] = EncoderDecoderConfig

    def check(self, experiment: Experiment) -> None:
        super().check(experiment)
        if experiment.data.task is None:
            from tfx.train.tasks import TASKS

            raise ValueError(f"objective {self.name!r} needs data.task, one of {TASKS}")

    def _loss(self) -> Loss:
        from tfx.train.losses import sequence_to_sequence

        return sequence_to_sequence

    def _loss_settings(self, experiment: Experiment) -> dict:
        return {"label_smoothing": experiment.label_smoothing}

    def _feed(self) -> type[TextFeed | TaskFeed]:
        from tfx.train.feed import TaskFeed

        return TaskFeed


@dataclasses.dataclass(frozen=True)
class SupervisedFineTuning(Objective):
    """Instruction / chat fine-tuning (SFT) on a JSONL file (tfx.train.instructions): the
    loss counts only completion or assistant tokens; the prompt conditions them."""

    name: ClassVar[str] = "sft"
    model_config: ClassVar[type] = DecoderConfig
    can_sample: ClassVar[bool] = True

    def _loss(self) -> Loss:
        from tfx.train.losses import supervised

        return supervised

    def _feed(self) -> type[TextFeed | TaskFeed]:
        from tfx.train.sft_feed import SftFeed

        return SftFeed


@dataclasses.dataclass(frozen=True)
class PreferenceTuning(Objective):
    """Preference tuning on (prompt, chosen, rejected) triples (experiment.preference: DPO,
    IPO or SimPO)."""

    name: ClassVar[str] = "dpo"
    model_config: ClassVar[type] = DecoderConfig
    can_sample: ClassVar[bool] = True

    def check(self, experiment: Experiment) -> None:
        super().check(experiment)
        if experiment.data.packing:
            raise ValueError("objective 'dpo' takes no data.packing: each pair is its own row")

    def prepare(self, feed, model) -> None:
        """Full fine-tuning keeps no frozen copy of the weights: the starting model scores
        every pair once, and the batches carry those reference log-probs. (With LoRA the
        reference is the model with its adapter off; SimPO needs none.)"""
        experiment = feed.experiment
        if experiment.peft.method != "full" or experiment.preference.loss == "simpo":
            return
        import jax
        from flax import nnx

        from tfx.train.preference import reference_logps

        model.eval()
        graphdef, state = nnx.split(model)  # the weights as an argument, not constants
        score = jax.jit(lambda state, batch: reference_logps(nnx.merge(graphdef, state), batch))
        feed.precompute_reference(functools.partial(score, state))

    def _loss(self) -> Loss:
        from tfx.train.preference import dpo_loss

        return dpo_loss

    def _loss_settings(self, experiment: Experiment) -> dict:
        p = experiment.preference
        return {"beta": p.beta, "loss_type": p.loss, "simpo_gamma": p.simpo_gamma}

    def _feed(self) -> type:
        from tfx.train.preference import PreferenceFeed

        return PreferenceFeed


# Keyed by tfx.names.OBJECTIVES (Experiment.objective's choices), in its order.
OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    CausalLM(), MaskedLM(), SequenceToSequence(), SupervisedFineTuning(), PreferenceTuning())}


def get_objective(name: str) -> Objective:
    """The objective registered as `name`; ValueError listing the names otherwise."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective must be one of {tuple(OBJECTIVES)}, got {name!r}")
    return OBJECTIVES[name]


def __getattr__(name: str):
    """The loss functions by their old address (`from tfx.train.objectives import causal_lm`),
    imported with jax only when asked for."""
    if name in ("causal_lm", "masked_lm", "sequence_to_sequence"):
        from tfx.train import losses

        return getattr(losses, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
