"""The `tfx` command line as dataclasses, parsed by tyro: one subcommand per job, the field
docstrings as help. Imports no jax, so that `tfx --help` and `tfx train --help` print at once.

`tfx train [EXPERIMENT]`: each named experiment is a subcommand (default gpt_char) whose fields
are the options (`--model.num_layers=4`, `--optim.learning_rate 1e-3`); a fine-tuning method is
a subcommand of it (`peft:lora --peft.rank 8`, also spelt `--peft lora`). The loop's most used
settings drop their group (`--steps`, `--init-from`; `--train.steps` is still read), and a tyro
registry (`_registry`) lays the options out: the common ones first, alone in `tfx train --help`.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Annotated, Generic, TypeVar, Union

import tyro
from tyro.constructors import (
    ConstructorRegistry,
    StructConstructorSpec,
    StructFieldSpec,
    StructTypeInfo,
)

from tfx.models.config import OPTIONAL_SUBCONFIGS, POSITIONS, SUBCONFIGS, TransformerConfig
from tfx.train.config import DataConfig, Experiment, OptimConfig, TrainConfig
from tfx.train.experiments import DEFAULT_EXPERIMENT, EXPERIMENTS
from tfx.train.finetuning import METHODS
from tfx.train.overrides import switch_parts

__all__ = ["Embed", "Eval", "Experiments", "Export", "Sample", "Serve", "Tokenize", "Train",
           "parse"]

E = TypeVar("E")  # the experiments: subcommands whose defaults the command line adjusts


@dataclasses.dataclass(frozen=True, kw_only=True)
class Train(Generic[E]):
    """Train (or resume) an experiment; its fields are the options below."""

    experiment: E
    """The named experiment (`tfx experiments` lists them), with its fields overridden."""
    workdir: str
    """Where checkpoints, metrics.jsonl, loss.png and TensorBoard files go."""
    data: str | None = None
    """A text file or folder (sft, dpo: a JSONL file) to train on (data.source)."""
    no_progress: tyro.conf.FlagCreatePairsOff[bool] = False
    """No progress bar."""
    coordinator_address: str | None = None
    """Multi-process runs: host:port of process 0 (or TFX_COORDINATOR_ADDRESS)."""
    num_processes: int | None = None
    """Multi-process runs: how many (or TFX_NUM_PROCESSES)."""
    process_id: int | None = None
    """Multi-process runs: this one's index (or TFX_PROCESS_ID)."""

    def configured(self) -> Experiment:
        """The experiment with --data applied, once checked against its starting weights
        (train.init_from)."""
        e = self.experiment
        if self.data is not None:
            e = dataclasses.replace(e, data=dataclasses.replace(e.data, source=self.data))
        if e.train.init_from is not None:
            _refuse_model_options(e, e.train.init_from)
        return e


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """Generate text from a trained run."""

    workdir: str
    """The run's workdir."""
    prompt: str = ""
    """Text to continue."""
    max_new_tokens: int = 200
    """Tokens to generate."""
    temperature: float = 0.8
    """Sampling temperature; 0 for greedy decoding."""
    top_k: int | None = None
    """Sample among the k most likely tokens."""
    top_p: float | None = None
    """Sample among the most likely tokens that hold probability p (nucleus)."""
    num_samples: int = 1
    """Continuations of the prompt."""
    seed: int = 0
    """Seed of the sampling."""
    max_len: int | None = None
    """Longest sequence (prompt + new tokens) the KV cache holds; default: the model's max_len,
    raised to fit the request for models without learned positions."""
    chat: tyro.conf.FlagCreatePairsOff[bool] = False
    """Send the prompt as a user message through the tokenizer's chat template (with the
    assistant's turn opened) and stop at its end-of-turn token."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eval:
    """Metrics as JSON: a run's validation metrics, or with --data the loss and perplexity of a
    held-out file, or with --tasks lm-evaluation-harness tasks."""

    workdir: str
    """A run's workdir, or (with --data or --tasks) a Hugging Face folder."""
    data: str | None = None
    """A held-out text file, folder or JSONL file (text or sft lines) to score."""
    max_len: int | None = None
    """--data: tokens per scored window (default: the run's train.seq_len, else 1024)."""
    batch_size: int = 8
    """--data, --tasks: rows per model call."""
    tasks: tuple[str, ...] = ()
    """lm-evaluation-harness task names (lm-eval must be installed: the eval extra)."""
    include_path: str | None = None
    """--tasks: a folder of local task YAML files."""
    limit: int | None = None
    """--tasks: at most this many examples per task."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Export:
    """Write a run as a Hugging Face folder (merged weights, tokenizer, chat template) or, for a
    LoRA run, as a peft adapter folder."""

    workdir: str
    """The run's workdir."""
    to: str
    """The folder to write (it must not exist or be empty)."""
    merged: bool | None = None
    """LoRA runs: True writes merged weights, False a peft adapter; default: an adapter when
    the run started from a Hugging Face folder."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tokenize:
    """Tokenize text, JSONL or Parquet once into memory-mapped token shards, which
    `tfx train --data OUT` then reads per step (data larger than memory)."""

    sources: tyro.conf.Positional[tuple[str, ...]]
    """Text files or folders, .jsonl files ({"text": ...} lines) or .parquet files."""
    out: str
    """The folder to write (new or empty)."""
    tokenizer: str = "byte"
    """"byte", a tokenizer.json, or a transformers tokenizer folder (the model's)."""
    val_fraction: float = 0.05
    """Share of the documents held out for validation."""
    text_field: str = "text"
    """The JSONL field or Parquet column that holds each document."""
    no_progress: tyro.conf.FlagCreatePairsOff[bool] = False
    """No progress bar."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Embed:
    """Sentence embeddings: the cosine similarity of every pair of texts."""

    texts: tyro.conf.Positional[tuple[str, ...]]
    """The texts."""
    model: str | None = None
    """A sentence-transformers folder (default: the packaged all-MiniLM-L6-v2)."""
    output: Path | None = None
    """Also write the embeddings [len(texts), dim] here (.npy)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Serve:
    """Serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions,
    /v1/models, /health) until Ctrl-C or SIGTERM (the serve extra)."""

    path: tyro.conf.Positional[str]
    """A tfx run's workdir or a Hugging Face folder."""
    adapter: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """NAME=DIR: a LoRA adapter (a peft adapter folder or a tfx LoRA run) served as model NAME
    beside the base; repeat for more. Requests for different adapters share each step."""
    name: str | None = None
    """The base model's id in /v1/models (default: the folder's name)."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0: a free one, printed)."""
    max_batch: int = 16
    """Requests decoded at once (rows of each step)."""
    pages: int | None = None
    """KV cache pages of --page-size tokens (default: enough for --max-batch full-length
    requests)."""
    page_size: int = 16
    """Tokens per KV cache page."""
    chunk: int = 64
    """Prompt tokens a request prefills per step."""
    max_len: int | None = None
    """Longest sequence (prompt + new tokens) served (default: the model's max_len)."""
    prefix_cache: bool = True
    """Keep full pages of prompts for later requests that start the same way."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiments:
    """List the named experiments."""


def parse(args: list[str]
          ) -> Train | Sample | Eval | Export | Tokenize | Embed | Serve | Experiments:
    """The command that `args` (without the program name) spell. tyro prints help or an error
    (naming an unrecognised option and the similar ones) and exits 0 or 2."""
    experiments, train_help, registry = EXPERIMENTS, None, None
    if args[:1] == ["train"]:
        args, experiments, train_help, registry = _train_parser(args)
    commands = Union[  # noqa: UP007 (a Union of Annotated types: tyro's subcommands)
        Annotated[Train[_choices(experiments)],
                  tyro.conf.subcommand("train", prefix_name=False, description=train_help)],
        Annotated[Sample, tyro.conf.subcommand("sample", prefix_name=False)],
        Annotated[Eval, tyro.conf.subcommand("eval", prefix_name=False)],
        Annotated[Export, tyro.conf.subcommand("export", prefix_name=False)],
        Annotated[Tokenize, tyro.conf.subcommand("tokenize", prefix_name=False)],
        Annotated[Embed, tyro.conf.subcommand("embed", prefix_name=False)],
        Annotated[Serve, tyro.conf.subcommand("serve", prefix_name=False)],
        Annotated[Experiments, tyro.conf.subcommand("experiments", prefix_name=False)]]
    return tyro.cli(commands, args=args, prog="tfx", use_underscores=True,
                    description="tfx: transformer building blocks and models for JAX and Flax "
                    "NNX: train, sample, evaluate, export, tokenize, embed.",
                    config=(tyro.conf.CascadeSubcommandArgs,), registry=registry)


# `tfx train --help` without an experiment: what most runs set, then where the rest is.
_SHORT_HELP = (
    f"Train an experiment (default: {DEFAULT_EXPERIMENT}); the same command resumes a stopped "
    f"run. The options most runs set, with {DEFAULT_EXPERIMENT}'s defaults, are below; "
    "`tfx train EXPERIMENT --help` lists every option of an experiment, in sections.\n\n"
    "Fine-tuning: `tfx train sft --init-from HF_FOLDER --data chats.jsonl --workdir DIR "
    f"--peft lora` (docs/finetuning.md); --peft {{{','.join(METHODS)}}} picks what trains "
    "(--peft.rank 8 ...: its settings).")

# The options of each struct that most runs set: listed first, in this order, and alone in
# `tfx train --help`. Model families share the TransformerConfig entry.
_COMMON = {Train: ("workdir", "data", "experiment"), Experiment: ("train", "optim", "model"),
           TrainConfig: ("steps", "init_from", "batch_size", "seq_len"), DataConfig: (),
           OptimConfig: ("learning_rate",), TransformerConfig: ("num_layers", "d_model",
                                                                 "num_heads")}
# The loop's settings spelt without their group: --steps, not --train.steps.
_SHORT_NAMES = ("steps", "checkpoint_every", "log_every", "init_from")
# Spellings that `_aliases` still reads, which the help never lists (no option shows twice):
# the grouped ones, and data.source, which --data (Train.data) sets.
_OLD_NAMES = {**{f"train.{name}": name for name in _SHORT_NAMES}, "data.source": "data"}
# Fields no option sets: an experiment's name is its subcommand's (another would name no
# experiment), and its data.source is --data's.
_HIDDEN = {Experiment: "name", DataConfig: "source"}
# Optional model parts switched on by naming their options; those named after a position kind
# (rope, t5) come with --model.position instead.
_SWITCHABLE = tuple(part for part in OPTIONAL_SUBCONFIGS if part not in POSITIONS)


def _train_parser(args: list[str]) -> tuple[list[str], dict[str, Experiment], str | None,
                                            ConstructorRegistry]:
    """How `tfx train` reads `args`: (the args with `_aliases` spelt as tyro reads them, the
    experiments with the chosen one's optional model parts switched as the args name them,
    the train command's description, the tyro registry that lays its options out)."""
    args = _aliases(args)
    named = next((arg for arg in args if arg in EXPERIMENTS), None)
    chosen = named or DEFAULT_EXPERIMENT
    # Optional model sub-configs named on the command line (--model.moe.num_experts=8 on a
    # dense model, --model.moe=None) are switched on or off in the default tyro overrides.
    experiment, args = switch_parts(EXPERIMENTS[chosen], args)
    helping = "-h" in args or "--help" in args
    # No experiment (nor a fine-tuning method) named: the short help.
    short = helping and named is None and not any(arg.startswith("peft:") for arg in args)
    notes = {}
    if helping and not short:
        experiment, notes = _parts_listed(experiment)
    return (args, {**EXPERIMENTS, chosen: experiment}, _SHORT_HELP if short else None,
            _registry(short, experiment.model, notes))


def _parts_listed(experiment: Experiment) -> tuple[Experiment, dict[str, str]]:
    """(the experiment with the optional model parts it leaves out switched on, where its
    model takes them as they are, {part: the help of its group}): the experiment's help lists
    their options too, saying that they are off."""
    model, notes = experiment.model, {}
    for part in _SWITCHABLE:
        if getattr(model, part, False) is not None:  # on, or not a part of this family
            continue
        try:
            model = model.replace(**{part: SUBCONFIGS[part]()})
        except ValueError:  # it needs other changes (latent attention: num_kv_heads=None)
            continue
        notes[part] = (f"Off in {experiment.name}: naming any of these options switches it "
                       f"on, with the defaults shown (--model.{part}=None: off). "
                       f"{inspect.getdoc(SUBCONFIGS[part])}")
    return dataclasses.replace(experiment, model=model), notes


def _registry(short: bool, model: TransformerConfig, notes: dict[str, str]
              ) -> ConstructorRegistry:
    """tyro's reading of the train command's structs, adjusted: the `_COMMON` options first
    (and alone when `short`), `_SHORT_NAMES`, no `_HIDDEN` fields, and `notes` (part -> the
    help of its group) on the chosen experiment's `model`."""
    registry = ConstructorRegistry()
    asking = []  # not empty while the rule asks tyro for a struct's own reading

    @registry.struct_rule
    def adjusted(info: StructTypeInfo):
        kind = next((struct for struct in _COMMON
                     if isinstance(info.type, type) and issubclass(info.type, struct)), None)
        if kind is None or asking:
            return None
        asking.append(True)
        try:
            spec = ConstructorRegistry.get_struct_spec(info)
        finally:
            asking.pop()
        if not isinstance(spec, StructConstructorSpec):  # tyro's error: let it report it
            return spec
        first = _COMMON[kind]
        fields = sorted(spec.fields, key=lambda field: first.index(field.name)
                        if field.name in first else len(first))
        off = notes if info.default == model else {}
        return dataclasses.replace(spec, fields=tuple(
            _field(kind, field, short, off) for field in fields))

    return registry


def _field(kind: type, field: StructFieldSpec, short: bool, off: dict[str, str]
           ) -> StructFieldSpec:
    """A field of a struct of type `kind` as the train command shows it (`short`: in the short
    help; `off`: part -> the help of its group, for the model parts that are off)."""
    if (short and field.name not in _COMMON[kind]) or _HIDDEN.get(kind) == field.name:
        return dataclasses.replace(field, type=Annotated[field.type, tyro.conf.Suppress])
    if short and kind is Experiment:
        # A group without its description (and the model as its family, whose description tyro
        # would print): the help stays short.
        field = dataclasses.replace(field, type=type(field.default), helptext="")
    if kind is TrainConfig and field.name in _SHORT_NAMES:
        return dataclasses.replace(field, type=Annotated[
            field.type, tyro.conf.arg(name=field.name, prefix_name=False)])
    if kind is TransformerConfig and field.name in off:  # as its type, not X | None: tyro then
        # prints this help above its options
        return dataclasses.replace(field, type=SUBCONFIGS[field.name], helptext=off[field.name])
    return field


def _choices(experiments: dict[str, Experiment]):
    """The experiments as tyro subcommands, DEFAULT_EXPERIMENT chosen when none is named; their
    options take a value even when it is a bool (`--model.compute.remat True`)."""
    union = Union[tuple(  # noqa: UP007
        Annotated[Experiment, tyro.conf.subcommand(name, default=e, description=_summary(e),
                                                   prefix_name=False)]
        for name, e in experiments.items())]
    # name "": the experiment's options are --model.*, --train.*, not --experiment.model.*
    return Annotated[union, tyro.conf.FlagConversionOff,
                     tyro.conf.arg(name="", default=experiments[DEFAULT_EXPERIMENT],
                                   prefix_name=False)]


def _refuse_model_options(experiment: Experiment, init_from: str) -> None:
    """A Hugging Face folder gives the model: refuse --model.* options that would change what
    it is (only how it computes, model.compute.* and model.attention.implementation, may
    change), rather than ignore them."""
    from tfx.train.pretrained import is_hf_base

    preset = EXPERIMENTS[experiment.name].model
    if not is_hf_base(init_from) or type(experiment.model) is not type(preset):
        return
    allowed = dataclasses.replace(preset, compute=experiment.model.compute, attention=(
        dataclasses.replace(preset.attention,
                            implementation=experiment.model.attention.implementation)))
    changed = [f.name for f in dataclasses.fields(preset)
               if getattr(experiment.model, f.name) != getattr(allowed, f.name)]
    if changed:
        raise ValueError(f"--init-from {init_from} gives the model (its config.json): "
                         f"model.{', model.'.join(changed)} cannot be set; only "
                         "model.compute.* and model.attention.implementation can")


def _summary(experiment: Experiment) -> str:
    model = experiment.model
    return (f"{experiment.objective}: {type(model).__name__} {model.num_layers}x{model.d_model}, "
            f"position={model.position}")


def _aliases(args: list[str]) -> list[str]:
    """Spellings that tfx reads besides tyro's: `--peft lora` / `--peft=lora` -> `peft:lora`
    (tyro's name of that subcommand), and `_OLD_NAMES` (`--train.steps=5` -> `--steps=5`)."""
    out, i = [], 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name == "--peft" and (eq or i + 1 < len(args)):
            out.append(f"peft:{value if eq else args[i + 1]}")
            i += 1 if eq else 2
            continue
        new = _OLD_NAMES.get(name[2:].replace("-", "_")) if name.startswith("--") else None
        out.append(args[i] if new is None else f"--{new}{eq}{value}")
        i += 1
    return out
