"""What a training run is: an `Experiment` = model config + objective + data + optimiser + loop
settings + mesh. Frozen, validated dataclasses, overridden from the command line by tyro
(`--model.num_layers=4`, `--model.moe.num_experts=8`, `--optim.learning_rate=1e-3`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import tyro

from tfx import names
from tfx.models.config import SUBCONFIGS, DecoderConfig, EncoderConfig, EncoderDecoderConfig
from tfx.train.finetuning import METHODS, FullTuning, PeftConfig
from tfx.train.migration import CONFIG_VERSION, migrate
from tfx.train.objectives import get_objective

__all__ = ["DataConfig", "Experiment", "MeshConfig", "OptimConfig", "PeftConfig",
           "PreferenceConfig", "TrainConfig",
           "experiment_from_dict", "non_empty_path", "run_identity", "stored_identity"]

# The model sub-configs switch on and off by name (tfx.train.overrides.switch_parts), never as
# tyro subcommands; the experiment's other unions (peft) are subcommands.
ModelConfig = Annotated[DecoderConfig | EncoderConfig | EncoderDecoderConfig,
                        tyro.conf.AvoidSubcommands]



def _positive(name: str, value) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _at_least(name: str, value, low) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def non_empty_path(name: str, value) -> None:
    """Refuse an empty (or blank) path `value` of the argument `name`: pathlib reads "" as ".",
    so it would silently mean the current directory."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{name} must not be an empty path (it would mean the current "
                         f"directory), got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio`·peak, global-norm clipping."""

    learning_rate: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 50
    """Steps of linear warmup from 0 to the peak."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay (matrices only, not vectors)."""
    b1: float = 0.9
    """Adam's first-moment decay."""
    b2: float = 0.95
    """Adam's second-moment decay."""
    grad_clip: float | None = 1.0
    """Largest global gradient norm; None for no clipping."""

    def __post_init__(self):
        _positive("learning_rate", self.learning_rate)
        _at_least("warmup_steps", self.warmup_steps, 0)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _at_least("weight_decay", self.weight_decay, 0.0)
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.grad_clip is not None:
            _positive("grad_clip", self.grad_clip)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The loop: `steps` optimiser updates of `batch_size` sequences, each the sum of
    `grad_accum` micro-batches (batch_size must divide into them).

    A step with a non-finite loss, gradient norm or update is never applied (tfx.train.step);
    `nonfinite` says what the loop does then: "stop" raises `DivergenceError` at the next log,
    eval or checkpoint step, before saving anything; "skip" goes on (the step's batch is
    dropped, as large-scale trainers do) and logs the count, and stops only when more than
    `max_consecutive_skips` steps in a row were skipped (a state that no batch can fix).

    A model with experts (`model.moe`) adds `load_balancing_weight` · load-balancing loss +
    `router_z_weight` · router z-loss to its training loss; with moe.policy="deepseek" its
    selection biases move by `router_bias_rate` per step toward balance."""

    steps: int = 600
    """Total optimiser steps."""
    batch_size: int = 16
    """Sequences per step."""
    seq_len: int = 256
    """Tokens per sequence."""
    grad_accum: int = 1
    """Micro-batches per step (they must divide batch_size)."""
    seed: int = 0
    """Seed of the initialisation, the batches and the steps' random keys."""
    log_every: int = 10
    """Steps between logged training metrics."""
    eval_every: int = 200
    """Steps between validation evaluations."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    checkpoint_every: int = 200
    """Steps between checkpoints."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept."""
    init_from: str | None = None
    """The starting weights (fine-tuning): a tfx run's workdir (its newest checkpoint) or a
    Hugging Face folder, which also gives the model and the tokenizer."""
    nonfinite: Literal[names.NONFINITE_ACTIONS] = "stop"
    """What a step with a non-finite loss or gradient does: stop the run, or skip the step."""
    max_consecutive_skips: int = 10
    """nonfinite="skip": more skipped steps in a row than this stop the run."""
    load_balancing_weight: float = 0.01
    """Weight of the experts' load-balancing loss (models with model.moe)."""
    router_z_weight: float = 0.001
    """Weight of the router z-loss (models with model.moe)."""
    router_bias_rate: float = 0.001
    """Per-step move of the selection biases toward balance (moe.policy="deepseek")."""
    sample_prompt: str | None = None
    """The prompt of the sample `tfx train` prints at the end; None: from the data (the first
    line of the first validation text; sft, dpo: the first prompt of the data file)."""

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every",
                     "eval_batches", "checkpoint_every", "keep_checkpoints",
                     "max_consecutive_skips"):
            _at_least(name, getattr(self, name), 1)
        if self.nonfinite not in names.NONFINITE_ACTIONS:
            raise ValueError(f"nonfinite must be one of {names.NONFINITE_ACTIONS}, got "
                             f"{self.nonfinite!r}")
        non_empty_path("train.init_from", self.init_from)
        if not isinstance(self.sample_prompt, str | None):
            raise TypeError(f"train.sample_prompt must be a str or None, got "
                            f"{self.sample_prompt!r}")
        for name in ("load_balancing_weight", "router_z_weight", "router_bias_rate"):
            _at_least(f"train.{name}", getattr(self, name), 0.0)
        if self.batch_size % self.grad_accum:
            raise ValueError(f"grad_accum ({self.grad_accum}) must divide batch_size "
                             f"({self.batch_size})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from. `source`: None for the embedded corpus (the Python standard
    library's own source files), or a text file / folder; `task`: a synthetic seq2seq task
    (tfx.train.tasks) instead of text."""

    source: str | None = None
    """A text file or folder; None for the embedded corpus (the standard library's source)."""
    tokenizer: str = "byte"
    """"byte" (byte-level ids) or the path of a tokenizers tokenizer.json."""
    val_fraction: float = 0.05
    """Share of the files held out for validation (split by a hash of their path)."""
    task: Literal[names.TASKS] | None = None
    """A synthetic seq2seq task instead of text."""
    min_len: int = 4
    """Shortest task input."""
    max_len: int = 16
    """Longest task input."""
    packing: bool = False
    """Pack whole documents (files, lines of a single file, task or sft examples) into rows,
    kept apart by segment ids, instead of cutting windows across them."""
    skip_bad_lines: bool = False
    """sft, dpo: skip (and count) JSONL lines that are malformed or longer than a row,
    instead of stopping at the first with its file and line number."""

    def __post_init__(self):
        for name in ("packing", "skip_bad_lines"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"data.{name} must be a bool, got {getattr(self, name)!r}")
        non_empty_path("data.source", self.source)
        non_empty_path("data.tokenizer", self.tokenizer)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        _at_least("min_len", self.min_len, 1)
        if self.max_len < self.min_len:
            raise ValueError(f"max_len ({self.max_len}) must be >= min_len ({self.min_len})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceConfig:
    """Preference tuning (objective dpo) on (prompt, chosen, rejected) triples: DPO's sigmoid
    loss (Rafailov et al. 2023), IPO (Azar et al. 2023) or the reference-free SimPO (Meng et
    al. 2024). With LoRA the reference is the model with its adapter switched off."""

    beta: float = 0.1
    """How far the policy may move from the reference (DPO's β; SimPO's reward scale)."""
    loss: Literal[names.PREFERENCE_LOSSES] = "sigmoid"
    """The preference loss."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (gamma)."""

    def __post_init__(self):
        _positive("preference.beta", self.beta)
        if self.loss not in names.PREFERENCE_LOSSES:
            raise ValueError(f"preference.loss must be one of {names.PREFERENCE_LOSSES}, got "
                             f"{self.loss!r}")
        _at_least("preference.simpo_gamma", self.simpo_gamma, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh axis sizes (see tfx.parallel). data = -1 takes the devices left over."""

    data: int = -1
    """Data-parallel size; -1 for the devices that the other axes leave."""
    fsdp: int = 1
    """Fully-sharded data-parallel size: parameters and optimiser state sharded."""
    tensor: int = 1
    """Tensor-parallel size (Megatron-style splits of attention and MLP)."""
    expert: int = 1
    """Expert-parallel size: MoE experts split over it."""
    sequence: int = 1
    """Context-parallel size: every sequence split over it, attention run as ring attention."""

    def __post_init__(self):
        if self.data != -1:
            _at_least("data", self.data, 1)
        for name in ("fsdp", "tensor", "expert", "sequence"):
            _at_least(name, getattr(self, name), 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
    """A named, complete training run. `objective` names what it trains for
    (tfx.train.objectives), which picks the loss, the batches and the model family: causal_lm ->
    DecoderConfig, mlm -> EncoderConfig, seq2seq -> EncoderDecoderConfig."""

    name: str
    objective: Literal[names.OBJECTIVES]
    """What the run trains for (tfx.train.objectives.OBJECTIVES): causal_lm, mlm, seq2seq, sft
    (instructions or chats, loss on the answers) or dpo (preference pairs)."""
    model: ModelConfig
    """The model (its family follows the objective)."""
    train: TrainConfig = TrainConfig()
    """The loop."""
    optim: OptimConfig = OptimConfig()
    """The optimiser."""
    data: DataConfig = DataConfig()
    """Where tokens come from."""
    mesh: MeshConfig = MeshConfig()
    """Device mesh axis sizes."""
    peft: PeftConfig = dataclasses.field(default_factory=FullTuning)
    """What fine-tuning trains: every weight (full) or a tfx.peft method's parameters."""
    label_smoothing: float = 0.0
    """seq2seq: label smoothing of the cross-entropy."""
    mlm_probability: float = 0.15
    """mlm: share of the real tokens chosen for prediction."""
    preference: PreferenceConfig = PreferenceConfig()
    """dpo: the preference loss and its settings."""

    def __post_init__(self):
        get_objective(self.objective).check(self)  # its model family, data it needs
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {self.mlm_probability}")
        if self.model.position == "learned" and self.train.seq_len > self.model.max_len:
            raise ValueError(f"train.seq_len ({self.train.seq_len}) exceeds the learned position "
                             f"table (model.max_len = {self.model.max_len})")
        if self.mesh.sequence > 1:
            _check_context_parallel(self)

    def to_dict(self) -> dict:
        """JSON-able form; dataclasses carry their class under "__type__" so that
        `experiment_from_dict` rebuilds the same objects, and "version" says the layout
        (tfx.train.migration)."""
        return {"version": CONFIG_VERSION, **_encode(self)}


# Positional encodings that add a score bias, which context-parallel attention does not take.
_BIASED_POSITIONS = ("alibi", "t5", "xl")


def _check_context_parallel(experiment: Experiment) -> None:
    """Refuse, before any work, a run that mesh.sequence > 1 could not split: a model whose
    attention adds a position bias or is not self-attention alone, or a sequence length that
    does not cut into 2 chunks per device (the causal load balance)."""
    devices, model = experiment.mesh.sequence, experiment.model
    if experiment.objective == "seq2seq" or model.position in _BIASED_POSITIONS:
        raise ValueError(f"mesh.sequence={devices} (context parallelism) needs self-attention "
                         f"without a position bias: objective {experiment.objective!r} with "
                         f"model.position={model.position!r} cannot use it")
    chunks = 2 * devices
    if experiment.train.seq_len % chunks:
        raise ValueError(f"mesh.sequence={devices} needs train.seq_len divisible by {chunks} "
                         f"(2 chunks per device), got {experiment.train.seq_len}")


# Loop settings that may change between a run and its resumption: they change no step that the
# run keeps (`nonfinite` only decides what follows a step that was not applied), so a diverged
# run may resume with nonfinite="skip".
LOOP_ONLY = ("log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
             "nonfinite", "max_consecutive_skips", "sample_prompt")


def run_identity(experiment: Experiment) -> dict:
    """What makes two runs the same run: the experiment without LOOP_ONLY settings and the
    mesh (a run may resume on another topology: orbax reshards the checkpoint)."""
    identity = experiment.to_dict()
    identity.pop("mesh")
    identity["train"] = {k: v for k, v in identity["train"].items() if k not in LOOP_ONLY}
    # Fine-tuning settings at their defaults are left out, so that runs stored before they
    # existed keep their identity (and resume).
    if experiment.peft == FullTuning():
        identity.pop("peft")
    if experiment.train.init_from is None:
        identity["train"].pop("init_from")
    return identity


def stored_identity(stored: dict) -> dict:
    """The run identity of a stored one (a workdir's config.json), of any config version:
    migrated to the current layout (`tfx.train.migration.migrate`) and rebuilt, so that fields
    the stored form leaves out compare at their defaults."""
    return run_identity(experiment_from_dict(stored))


def experiment_from_dict(data: dict) -> Experiment:
    """Inverse of `Experiment.to_dict`, for any stored config version (migrated first; missing
    fields take their defaults)."""
    data = migrate(data)
    data.pop("version")
    return _decode(data)


def _types() -> dict[str, type]:
    from tfx.models.config import EncoderConfig, EncoderDecoderConfig
    from tfx.ops.positional import SCALINGS

    known = (Experiment, TrainConfig, OptimConfig, DataConfig, MeshConfig, PreferenceConfig,
             *METHODS.values(),
             DecoderConfig, EncoderConfig, EncoderDecoderConfig, *SUBCONFIGS.values(),
             *SCALINGS)
    return {cls.__name__: cls for cls in known}


def _encode(value):
    if dataclasses.is_dataclass(value):
        return {"__type__": type(value).__name__,
                **{f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)
                   if f.init}}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot store {type(value).__name__} in an experiment config")


def _decode(value):
    if isinstance(value, dict):
        fields = {k: _decode(v) for k, v in value.items() if k != "__type__"}
        name = value.get("__type__")
        types = _types()
        if name not in types:
            raise ValueError(f"unknown config type {name!r} in a stored experiment")
        return types[name](**fields)
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value
