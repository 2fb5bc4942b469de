"""What `tfx train`, `tfx sample`, `tfx eval`, `tfx export` and `tfx experiments` do, once parsed
(tfx.cli.commands). jax is imported here, when a command runs, not when it is parsed."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from tfx.train.config import non_empty_path

__all__ = ["evaluate", "experiments", "export", "sample", "tokenize", "train"]


def train(command) -> int:
    """Train (or resume); print where the artifacts are, then a sample of a causal LM.

    A SIGINT or SIGTERM ends the command with one line on stderr and exit status 128 + the
    signal's number: while the loop trains (from its restore to its last save's commit) the
    first one saves the step and stops it (tfx.train.loop) and a second one stops at once;
    before and after, where there is nothing to save, the first one stops at once."""
    workdir = _workdir(command.workdir)
    experiment = command.configured()
    with _exits_at_once(lambda name: f"tfx train: stopped at once by {name}; the same command "
                        "resumes from the newest saved checkpoint") as at_once:
        from tfx import parallel
        from tfx.train.loop import train as train_loop

        # Multi-process runs (flags or TFX_* environment variables); one process: nothing.
        parallel.initialize(command.coordinator_address, command.num_processes,
                            command.process_id)
        result = train_loop(experiment, workdir, progress=not command.no_progress)
        at_once.line = lambda name: _interrupted(name, result.step, experiment, workdir)
        print(_artifacts(result.artifacts))
        if result.signal is not None:
            print(_interrupted(signal.Signals(result.signal).name, result.step, experiment,
                               workdir), file=sys.stderr)
            return 128 + result.signal
        if _samples(experiment):
            _closing_sample(experiment, workdir, result.step)
    return 0


def _interrupted(name: str, step: int, experiment, workdir: Path) -> str:
    """The line `tfx train` ends with when the signal `name` stopped it at `step` (saved)."""
    if step < experiment.train.steps:
        return f"tfx train: interrupted at step {step} by {name}; run the same command to resume"
    return (f"tfx train: interrupted by {name} after the last step ({step}, saved); `tfx sample "
            f"--workdir {workdir}` samples the run")


def _closing_sample(experiment, workdir: Path, step: int) -> None:
    """Print a continuation of the run's closing prompt (tfx.train.sampling.closing_prompt),
    read with the tokenizer the run trained with (a Hugging Face base's: `adopt_base`)."""
    from tfx.train.pretrained import adopt_base
    from tfx.train.sampling import closing_prompt

    prompt, chat = closing_prompt(adopt_base(experiment))
    text = _generate(workdir, prompt=prompt, max_new_tokens=200, temperature=0.8, chat=chat)
    print(f"sample after {step} steps for {prompt!r}:\n{text[0]}")


def _workdir(text: str) -> Path:
    """The --workdir path, refusing "" (which pathlib reads as the current folder)."""
    non_empty_path("--workdir", text)
    return Path(text)


def _artifacts(artifacts: dict[str, Path]) -> str:
    """The run's files that exist (TrainResult.artifacts: name -> path), on one line."""
    found = [f"{name}: {path}" for name, path in artifacts.items() if path.exists()]
    return "artifacts: " + ("; ".join(found) if found else "none yet")


def _samples(experiment) -> bool:
    """Whether the run's model continues text (its objective's `can_sample`)."""
    from tfx.train.objectives import get_objective

    return get_objective(experiment.objective).can_sample


def sample(command) -> int:
    """Print `num_samples` continuations of the prompt."""
    with _exits_at_once(lambda name: f"tfx sample: interrupted by {name}"):
        texts = _generate(_workdir(command.workdir), prompt=command.prompt,
                          max_new_tokens=command.max_new_tokens,
                          temperature=command.temperature,
                          top_k=command.top_k, top_p=command.top_p,
                          num_samples=command.num_samples, seed=command.seed,
                          max_len=command.max_len, chat=command.chat)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i}")
        print(text)
    return 0


def _exits_at_once(line: Callable[[str], str]):
    """A block in which SIGINT or SIGTERM ends the command at once: `line(name of the signal)`
    on stderr and exit status 128 + the signal's number (tfx.train.signals.ExitAtOnce, whose
    `line` the block may change). Where nothing is left half done: a KeyboardInterrupt inside
    orbax's restore or XLA's compilation printed tracebacks or crashed the interpreter's
    teardown."""
    from tfx.train.signals import ExitAtOnce, handling

    return handling(ExitAtOnce(line))


def _generate(workdir: Path, *, prompt: str, max_new_tokens: int, temperature: float,
              top_k=None, top_p=None, num_samples: int = 1, seed: int = 0,
              max_len: int | None = None, chat: bool = False) -> list[str]:
    """`num_samples` continuations of `prompt` by the run in `workdir` (tfx.train.load_run);
    with `chat`, of the prompt as a user turn of the tokenizer's chat template."""
    import jax
    import numpy as np

    import tfx
    from tfx.train.run import load_run, stored_experiment
    from tfx.train.sampling import chat_prompt, with_cache_length

    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    experiment = stored_experiment(workdir)
    if not _samples(experiment):  # refused before any model is built
        raise ValueError(f"{workdir} holds a {experiment.objective} run; sampling needs a "
                         "causal LM")
    run = load_run(workdir)  # a damaged newest checkpoint is refused
    ids, eos = (chat_prompt(run.tokenizer, prompt) if chat else
                (run.tokenizer.encode(prompt) if prompt else np.asarray([ord("\n")]),
                 getattr(run.tokenizer, "eos_id", None)))
    prompts = np.repeat(np.asarray(ids, np.int32)[None], num_samples, axis=0)
    model = with_cache_length(run.model, prompts.shape[1] + max_new_tokens, max_len)
    out = tfx.generate(model, prompts, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, top_p=top_p,
                       rng=jax.random.key(seed), eos_token_id=eos)
    shown = "" if chat else prompt
    return [shown + run.tokenizer.decode(np.asarray(row[prompts.shape[1]:])) for row in out]


def evaluate(command) -> int:
    """Print metrics as JSON: the run's validation metrics, or a held-out file's loss and
    perplexity (--data), or lm-evaluation-harness results (--tasks)."""
    if command.data is not None and command.tasks:
        raise ValueError("--data and --tasks are two evaluations: give one of them")
    with _exits_at_once(lambda name: f"tfx eval: interrupted by {name}"):
        return _evaluate(command, _workdir(command.workdir))


def _evaluate(command, path: Path) -> int:
    """`evaluate` of the run or Hugging Face folder at `path`."""
    if command.tasks:
        from tfx.evaluation import evaluate as harness

        results = harness(str(path), list(command.tasks), include_path=command.include_path,
                          limit=command.limit, batch_size=command.batch_size)
        print(json.dumps(results.get("results", results), indent=2, default=str))
        return 0
    if command.data is not None:
        from tfx.train.heldout import heldout_metrics
        from tfx.train.sampling import load_model

        model, tokenizer, seq_len = load_model(path)
        metrics = heldout_metrics(model, tokenizer, command.data,
                                  seq_len=command.max_len or seq_len,
                                  batch_size=command.batch_size)
        print(json.dumps({"data": command.data, **metrics}, indent=2))
        return 0
    return _validation(path)


def _validation(workdir: Path) -> int:
    """The validation metrics of the newest checkpoint (a Trainer: it holds the validation
    batches and the compiled evaluation step)."""
    from tfx.train.loop import Trainer
    from tfx.train.run import stored_experiment

    trainer = Trainer(stored_experiment(workdir), workdir, sharded=False)
    try:
        if trainer.restore(strict=True) == 0:  # a damaged newest checkpoint is refused
            raise ValueError(f"{workdir} holds no checkpoint yet")
        metrics = trainer.evaluate()
    finally:
        trainer.close()
    print(json.dumps({"step": int(trainer.state.step), **metrics}, indent=2))
    return 0


def export(command) -> int:
    """Write the run as a Hugging Face or peft folder; print where."""
    from tfx.train.export import export_run

    written = export_run(_workdir(command.workdir), _workdir(command.to), merged=command.merged)
    print(f"exported {command.workdir} to {written}")
    return 0


def tokenize(command) -> int:
    """Tokenize the sources into token shards (tfx.train.shards); print what was written."""
    from tfx.train.data import load_tokenizer
    from tfx.train.shard_writer import tokenize_to_shards

    for source in command.sources:
        non_empty_path("sources", source)
    non_empty_path("--out", command.out)
    manifest = tokenize_to_shards(list(command.sources), load_tokenizer(command.tokenizer),
                                  Path(command.out), val_fraction=command.val_fraction,
                                  progress=not command.no_progress,
                                  text_field=command.text_field)
    counts = ", ".join(f"{split} {info['tokens']:,} tokens in {info['documents']:,} documents"
                       for split, info in manifest.splits.items())
    print(f"wrote {command.out}: {counts}; train on it with `tfx train --data {command.out}`")
    return 0


def experiments(command) -> int:
    """List the named experiments, one a line."""
    from tfx.train.experiments import DEFAULT_EXPERIMENT, EXPERIMENTS

    for name, experiment in EXPERIMENTS.items():
        model = experiment.model
        default = " (default)" if name == DEFAULT_EXPERIMENT else ""
        print(f"{name:20s} {experiment.objective:10s} {type(model).__name__} "
              f"{model.num_layers}x{model.d_model} position={model.position}{default}")
    return 0
