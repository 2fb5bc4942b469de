"""Flat projections (`tfx.ops.matmul.flat_dot_general`) against 3-D `lax.dot_general` in tfx's
training step: the same model, weights and batch, only each `nnx.Linear`'s product differs.

    python benchmarks/flat_linear.py                 # both configs of benchmarks/train.py
    python benchmarks/flat_linear.py --quick         # 1 repeat: a smoke run
    python benchmarks/flat_linear.py --json benchmarks/results/flat_linear.json

For each config of `benchmarks/train.py` (batch 16 x 256, float32): the number of `copy`
instructions in the compiled step and the median step time of `--repeats` runs, the two
variants alternating (the order flips every repeat) after 2 warmup steps each.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import add_output_arguments, markdown_path, markdown_table, provenance, publish
from train import CONFIGS, SEQ_LEN, build_model

from tfx.ops.matmul import flat_dot_general
from tfx.peft.core import find_modules
from tfx.train.config import OptimConfig
from tfx.train.objectives import causal_lm
from tfx.train.optim import make_optimizer
from tfx.train.step import init_train_state, make_train_step

PRODUCTS = {"flat": flat_dot_general, "3-D": jax.lax.dot_general}


def runner(config, product, batch):
    """(step() -> seconds of one training step, copies in the compiled step)."""
    model = build_model(config)
    for _, linear in find_modules(model, nnx.Linear):
        linear.dot_general = product
    optimizer = make_optimizer(OptimConfig(), 100)
    graphdef, rest, state = init_train_state(model, optimizer, seed=0)
    train_step = make_train_step(graphdef, rest, optimizer, causal_lm)
    compiled = train_step.lower(state, batch).compile().as_text()
    box = [state]

    def step() -> float:
        start = time.perf_counter()
        box[0], metrics = train_step(box[0], batch)
        jax.block_until_ready(metrics["loss"])
        return time.perf_counter() - start

    for _ in range(2):
        step()
    return step, len(re.findall(r"= \S+ copy\(", compiled))


def measure(name: str, repeats: int) -> dict:
    tokens = np.random.default_rng(0).integers(0, 256, (16, SEQ_LEN))
    batch = {"tokens": jnp.asarray(tokens, jnp.int32)}
    runs = {kind: runner(CONFIGS[name][0], product, batch) for kind, product in PRODUCTS.items()}
    times = {kind: [] for kind in runs}
    for repeat in range(repeats):
        for kind in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
            times[kind].append(runs[kind][0]())
    seconds = {kind: statistics.median(values) for kind, values in times.items()}
    return {"copies": {kind: run[1] for kind, run in runs.items()}, "seconds": seconds,
            "speedup": seconds["3-D"] / seconds["flat"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    add_output_arguments(parser)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    results = {**provenance("flat_linear.py"),
               "configs": {name: measure(name, repeats) for name in CONFIGS}}
    rows = [(name, r["copies"]["3-D"], r["copies"]["flat"], r["seconds"]["3-D"],
             r["seconds"]["flat"], r["speedup"]) for name, r in results["configs"].items()]
    report = "\n".join([
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, {results['cpus']} CPUs.", "",
        f"## Training step, batch 16 x {SEQ_LEN}, float32: flat vs 3-D projections", "",
        f"Medians of {repeats} alternating steps.", "",
        markdown_table(["config", "copies 3-D", "copies flat", "step s 3-D", "step s flat",
                        "3-D time / flat"], rows)])
    publish(report, results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
