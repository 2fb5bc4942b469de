"""The `tfx` command (also `python -m tfx`).

    tfx train [EXPERIMENT] --workdir DIR [--data PATH] [--steps N] [--init_from FOLDER]
              [--peft lora --peft.rank 8 ...] [--checkpoint_every K] [--log_every L]
              [--model.num_layers=4 --model.moe.num_experts=8 --optim.learning_rate=1e-3 ...]
    tfx train sft --init-from HF_FOLDER --data chats.jsonl --workdir DIR [--peft lora ...]
    tfx sample --workdir DIR --prompt TEXT [--max_new_tokens N] [--temperature T] [--chat] ...
    tfx eval --workdir DIR [--data FILE | --tasks TASK ... --include-path DIR]
    tfx export --workdir DIR --to FOLDER [--merged True|False]
    tfx tokenize SOURCE ... --out DIR [--tokenizer FOLDER]
    tfx embed TEXT ... [--model FOLDER] [--output FILE.npy]
    tfx serve PATH [--adapter NAME=DIR ...] [--host H] [--port P] [--max-batch B] [--pages N]
    tfx experiments

One tyro parser (tfx.cli.commands) reads every command. `tfx train --help` shows the options
most runs set; `tfx train EXPERIMENT --help` lists every field of that experiment (the common
ones first, and the optional model parts it leaves out) with its description and choices, each
once. Exit status: 0 done, 2 a usage or config error (one line), 1 a failed run (one line),
128 + the signal's number when a signal stopped the work (130 Ctrl-C, 143 SIGTERM; a training
run saves first).
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import NoReturn

__all__ = ["command", "main"]


def command() -> NoReturn:
    """The `tfx` console script and `python -m tfx`: keep freed host memory for reuse
    (`tfx.train.host_memory`, which must run before JAX starts), run `main()`, and exit with its
    status without the interpreter's teardown. Tests call `main` directly and leave their own
    process's allocator as it is."""
    import logging
    import os

    from tfx.train.host_memory import keep_freed_memory

    keep_freed_memory()
    status = main()
    # With jax loaded the teardown takes a second or two, in which a Ctrl-C printed a
    # KeyboardInterrupt traceback from jax's atexit callback or killed the process without a
    # line. Every command has closed its files, checkpoints and threads by now; the processes of
    # a multi-process run leave together (jax.distributed's shutdown barrier, a no-op for one),
    # or the first to go would take the coordination service from the others.
    if "jax" in sys.modules:
        sys.modules["jax"].distributed.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    """Run the command that `argv` (default: sys.argv[1:]) spells; return its exit status."""
    name = "tfx"  # until the command is known
    try:
        from tfx.cli.commands import parse

        command = parse(sys.argv[1:] if argv is None else list(argv))
        name = f"tfx {type(command).__name__.lower()}"
        with warnings.catch_warnings():  # restores the previous showwarning
            warnings.showwarning = functools.partial(_show_warning, name)
            return _run(command)
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which saves and returns)
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError) as error:  # a bad config, data path or workdir
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the run failed: full disk, unwritable workdir
        print(f"{name}: error: {_one_line(error)}", file=sys.stderr)
        return 1
    except Exception as error:
        from tfx.train.loop import DivergenceError  # imported only once something failed

        if not isinstance(error, DivergenceError):
            raise
        print(f"{name}: error: {_one_line(error)}", file=sys.stderr)
        return 1


def _run(command) -> int:
    from tfx.cli import commands

    if isinstance(command, commands.Embed):
        from tfx.cli.embed import embed

        return embed(command)
    if isinstance(command, commands.Serve):
        from tfx.cli.serving import serve

        return serve(command)
    from tfx.cli import running

    handlers = {commands.Train: running.train, commands.Sample: running.sample,
                commands.Eval: running.evaluate, commands.Export: running.export,
                commands.Tokenize: running.tokenize,
                commands.Experiments: running.experiments}
    return handlers[type(command)](command)


def _one_line(error: BaseException) -> str:
    """The error's message and its notes (which say what was being done) on one line."""
    return "; ".join(" ".join(str(part).split()) for part in
                     (error, *getattr(error, "__notes__", ())))


def _show_warning(command, message, category, filename, lineno, file=None, line=None):
    """Warnings as one line for the command's user (no source location)."""
    print(f"{command}: warning: {message}", file=sys.stderr if file is None else file)
