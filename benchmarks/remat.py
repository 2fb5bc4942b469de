"""Rematerialisation policies (`compute.remat_policy`): memory and time of a training step's
forward and backward pass under each, against no remat in the same run.

    python benchmarks/remat.py                        # batch 8 x 256, 2 warmup, 7 repeats
    python benchmarks/remat.py --quick                # batch 4 x 128, 1 warmup, 2 repeats
    python benchmarks/remat.py --json benchmarks/results/remat.json   # also writes remat.md

The model is char-gpt (`tfx.models.PRESETS["char-gpt"]`: 4 layers, width 256, RoPE, RMSNorm,
SwiGLU 1024, GQA 4/2 heads, byte vocabulary) in float32, its layers unrolled and scanned
(`compute.scan_layers`). The step is `jax.jit(jax.value_and_grad(loss))` of the parameters,
loss the next-token cross entropy of a fixed random batch: the model's part of a training
step, without the optimiser (which no policy changes).

Memory is XLA's own account of the compiled step (`compiled.memory_analysis()`):
temp bytes, the buffers live inside the step (activations kept for the backward pass,
recomputed ones, gradients being summed), which is what a policy changes; arguments (the
parameters and batch) and outputs (loss and gradients) are the same for all. It is exact and
does not vary from run to run. Time is the median of --repeats steps, the variants alternating
(one step of each per repeat), so load on the machine falls on all alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import add_output_arguments, markdown_path, markdown_table, provenance, publish

from tfx.models import PRESETS, create
from tfx.models.parts import REMAT_POLICIES

CONFIG = PRESETS["char-gpt"]
NO_REMAT = "no remat"  # the peer: every variant's ratios are against it


def step_fn(scan: bool, policy: str | None, tokens: jax.Array):
    """(jitted step, params): step(params) -> (loss, gradients) of char-gpt on `tokens`
    [batch, seq + 1], rematerialised with `policy` (None: not)."""
    compute = {"scan_layers": scan} | ({} if policy is None else
                                       {"remat": True, "remat_policy": policy})
    model = create(CONFIG, compute=compute, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], -1))

    return jax.jit(jax.value_and_grad(loss)), params


def measure_layout(scan: bool, tokens: jax.Array, warmup: int, repeats: int) -> dict:
    """{variant: row} for no remat and every policy, layers scanned or unrolled."""
    variants = {NO_REMAT: None} | {name: name for name in REMAT_POLICIES}
    steps, rows = {}, {}
    for name, policy in variants.items():
        step, params = step_fn(scan, policy, tokens)
        start = time.perf_counter()
        compiled = step.lower(params).compile()
        compile_s = time.perf_counter() - start
        memory = compiled.memory_analysis()
        steps[name] = (compiled, params)
        rows[name] = {"compile_s": compile_s, "temp_bytes": memory.temp_size_in_bytes,
                      "argument_bytes": memory.argument_size_in_bytes,
                      "output_bytes": memory.output_size_in_bytes,
                      "loss": float(compiled(params)[0])}
    times = alternate(steps, warmup, repeats)
    for name, row in rows.items():
        row["step_s"] = statistics.median(times[name])
        row["step_s_all"] = times[name]
        row["temp_vs_no_remat"] = row["temp_bytes"] / rows[NO_REMAT]["temp_bytes"]
    for row in rows.values():
        row["time_vs_no_remat"] = row["step_s"] / rows[NO_REMAT]["step_s"]
    return rows


def alternate(steps: dict, warmup: int, repeats: int) -> dict:
    """Seconds of each compiled step per repeat, one step of each per repeat."""
    def run(compiled, params):
        jax.block_until_ready(compiled(params))

    for _ in range(warmup):
        for compiled, params in steps.values():
            run(compiled, params)
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, (compiled, params) in steps.items():
            start = time.perf_counter()
            run(compiled, params)
            times[name].append(time.perf_counter() - start)
    return times


def render(results: dict) -> str:
    """The markdown report of a results dict (as written by --json)."""
    lines = [
        "# Remat policies: memory and time of a training step (benchmarks/remat.py)", "",
        f"Command: `{results['command']}`, revision {results['revision']}, {results['date']}, "
        f"jax {results['jax']}, {results['platform']}, {results['cpus']} CPUs, load average at "
        f"start {results['load_average']} (a machine shared with other jobs).", "",
        f"char-gpt ({CONFIG.num_layers} layers, width {CONFIG.d_model}), float32, batch "
        f"{results['batch']} x {results['seq_len']} tokens; value_and_grad of the loss. "
        "Temp: XLA's temp buffers of the compiled step (exact); time: median of "
        f"{results['repeats']} alternating steps after {results['warmup']} warmup.", ""]
    for layout, rows in results["layouts"].items():
        lines += [f"## Layers {layout}", "", markdown_table(
            ["policy", "temp MiB", "temp / no remat", "step ms", "time / no remat",
             "compile s"],
            [[name, r["temp_bytes"] / 2**20, r["temp_vs_no_remat"], r["step_s"] * 1e3,
              r["time_vs_no_remat"], r["compile_s"]] for name, r in rows.items()]), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="batch 4 x 128, 1 warmup, 2 repeats")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq_len, args.warmup, args.repeats = 4, 128, 1, 2
    for name in ("batch", "seq_len", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len > CONFIG.max_len:
        parser.error(f"--seq-len must be <= {CONFIG.max_len} (char-gpt's context)")
    load = os.getloadavg()
    tokens = jnp.asarray(np.random.default_rng(0).integers(
        0, CONFIG.vocab_size, (args.batch, args.seq_len + 1)), jnp.int32)
    layouts = {layout: measure_layout(scan, tokens, args.warmup, args.repeats)
               for layout, scan in (("unrolled", False), ("scanned", True))}
    results = {**provenance("remat.py"), "load_average": [round(x, 1) for x in load],
               "platform": jax.default_backend(), "batch": args.batch, "seq_len": args.seq_len,
               "warmup": args.warmup, "repeats": args.repeats, "layouts": layouts}
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
