"""The gated delta rule, chunked (`tfx.ops.linear_attention.gated_delta_rule`), against its
token loop and against softmax attention's blocked kernel at the same sequence length.

    python benchmarks/delta_rule.py                  # N = 1k .. 16k, 1 warmup, 5 repeats
    python benchmarks/delta_rule.py --quick          # N = 256 .. 1k, 1 repeat
    python benchmarks/delta_rule.py --json benchmarks/results/delta_rule.json

One layer's token mixing at batch 1, 4 heads of width 64 (queries, keys, values), float32:
the forward pass, and the forward and backward pass (`jax.grad` of the outputs' sum) of
  - "chunked": the gated delta rule in chunks of 64 (work O(N·64·d + N·d²));
  - "recurrent": the same rule token by token (`gated_delta_recurrent`, a scan over N);
  - "blocked softmax": causal `tfx.ops.dot_product_attention(implementation="blocked")`,
    O(N²·d) work.
Times are medians of --repeats calls of each compiled function, the variants alternating, so
load on the machine falls on all alike. The exponent is the least-squares slope of log time
against log N: 1 for linear growth, 2 for quadratic.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import add_output_arguments, markdown_path, markdown_table, provenance, publish

from tfx.ops import dot_product_attention
from tfx.ops.linear_attention import gated_delta_recurrent, gated_delta_rule

HEADS, DIM = 4, 64


def inputs(length: int) -> tuple[jax.Array, ...]:
    """Queries, keys (unit length, as Qwen3-Next feeds them), values, log decays and betas of
    one sequence of `length` tokens."""
    keys = jax.random.split(jax.random.key(0), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = (unit(jax.random.normal(key, (1, length, HEADS, DIM))) for key in keys[:2])
    v = jax.random.normal(keys[2], (1, length, HEADS, DIM))
    g = -jax.random.uniform(keys[3], (1, length, HEADS), maxval=0.1)
    beta = jax.random.uniform(keys[4], (1, length, HEADS))
    return q, k, v, g, beta


VARIANTS = {
    "chunked": lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, chunk_size=64)[0],
    "recurrent": lambda q, k, v, g, b: gated_delta_recurrent(q, k, v, g, b)[0],
    "blocked softmax": lambda q, k, v, g, b: dot_product_attention(
        q, k, v, is_causal=True, implementation="blocked"),
}


def compiled(variant, backward: bool, args):
    """The jitted forward (or forward and backward) pass of a variant on `args`."""
    fn = VARIANTS[variant]
    if backward:
        grad = jax.grad(lambda *x: jnp.sum(fn(*x)), argnums=(0, 1, 2))
        return jax.jit(grad).lower(*args).compile()
    return jax.jit(fn).lower(*args).compile()


def measure(length: int, backward: bool, warmup: int, repeats: int) -> dict[str, float]:
    """{variant: median seconds} at one sequence length, the variants alternating."""
    args = inputs(length)
    runs = {name: compiled(name, backward, args) for name in VARIANTS}
    times = {name: [] for name in runs}
    for repeat in range(warmup + repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run(*args))
            if repeat >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def exponent(lengths: list[int], seconds: list[float]) -> float:
    """The slope of log(seconds) against log(length)."""
    return float(np.polyfit(np.log(lengths), np.log(seconds), 1)[0])


def render(results: dict) -> str:
    """The markdown report of a results dict (as written by --json)."""
    lines = ["# The gated delta rule against its token loop and blocked softmax attention "
             "(benchmarks/delta_rule.py)", "",
             f"Command: `{results['command']}`, revision {results['revision']}, "
             f"{results['date']}, jax {results['jax']}, {results['platform']}, "
             f"{results['cpus']} CPUs, load average at start {results['load_average']}.", "",
             f"Batch 1, {HEADS} heads of width {DIM}, float32, causal; median of "
             f"{results['repeats']} alternating calls after {results['warmup']} warmup.", ""]
    lengths = results["lengths"]
    for mode, rows in results["modes"].items():
        headers = ["N", *(f"{name} ms" for name in VARIANTS), "softmax / chunked"]
        table = [[n, *(rows[name][i] * 1e3 for name in VARIANTS),
                  rows["blocked softmax"][i] / rows["chunked"][i]]
                 for i, n in enumerate(lengths)]
        fits = ", ".join(f"{name} {exponent(lengths, rows[name]):.2f}" for name in VARIANTS)
        lines += [f"## {mode}", "", markdown_table(headers, table), "",
                  f"Exponent of time in N: {fits}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192,
                                                                   16384])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="N = 256, 512, 1024; 1 repeat")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.warmup, args.repeats = [256, 512, 1024], 0, 1
    if min(args.lengths) < 1 or args.repeats < 1:
        parser.error("--lengths and --repeats must be >= 1")
    load = os.getloadavg()
    modes = {}
    for mode, backward in (("forward", False), ("forward and backward", True)):
        per_length = [measure(n, backward, args.warmup, args.repeats) for n in args.lengths]
        modes[mode] = {name: [row[name] for row in per_length] for name in VARIANTS}
    results = {**provenance("delta_rule.py"), "load_average": [round(x, 1) for x in load],
               "platform": jax.default_backend(), "lengths": args.lengths,
               "warmup": args.warmup, "repeats": args.repeats, "modes": modes}
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
