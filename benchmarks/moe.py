"""Mixture-of-experts layer speed: tfx.ops.moe's dispatch implementations vs each other and vs a
dense MLP with the same active parameters per token.

    python benchmarks/moe.py                           # the full table (about ten minutes)
    python benchmarks/moe.py --quick                   # 1024 tokens, width 128: a smoke run
    python benchmarks/moe.py --json benchmarks/results/moe.json   # also writes moe.md

8192 tokens, d_model 512, expert d_ff 1024, SwiGLU experts (gate, up, down), float32,
E in {8, 64} experts, k in {1, 2} experts per token, top-k routing ("position" priority).
Each step is forward+backward: jax.grad of sum(output) with respect to x, the router kernel and
every weight, jitted (compilation excluded: the first call is a warmup), median of --repeats
calls on the same inputs, the implementations of one (E, k) called in alternation. Compiled
with the training step's CPU options (`tfx.train.step.compiler_options`: XLA's defaults for a
model with experts, no YNNPACK fusions for a dense one), as each layer runs in training.

Implementations of `tfx.ops.moe.moe` (router included in every MoE time):
- sorted: tfx's default dispatch (assignments sorted by expert, blocked grouped matmul);
- onehot: GShard's [tokens, E, capacity] dispatch and combine einsums, the reference;
- ragged: `jax.lax.ragged_dot` on the sorted rows. On CPU XLA computes every expert on every
  row (E times the work): run only where E <= --ragged-max-experts, "-" elsewhere;
- dense: a SwiGLU MLP with d_ff·k hidden units, the same active parameters per token.
sorted and onehot are compared with the same routing and capacity factor 1.25 (onehot needs a
capacity: dropless it would be [tokens, E, tokens]); sorted is also timed dropless (no
capacity), the setting `moe_vs_dense_active` uses.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
from timing import markdown_table, provenance, publish, write_json

from tfx.ops.moe import ExpertWeights, grouped_matmul, moe, route, router_logits
from tfx.ops.moe.dispatch import block_layout
from tfx.train.host_memory import keep_freed_memory
from tfx.train.step import compiler_options

CAPACITY_FACTOR = 1.25
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}  # XLA CPU without YNNPACK fusions
GOALS = {"sorted_vs_onehot": 0.33, "moe_vs_dense_active": 1.5}
BLOCK = 128  # rows per block of "sorted": experts_ffn's default block_size




def _inputs(tokens: int, d_model: int, d_ff: int, experts: int):
    """x [tokens, d_model], router kernel [d_model, E] and SwiGLU expert weights, N(0, 1/fan_in)."""
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (tokens, d_model))
    router = jax.random.normal(keys[1], (d_model, experts)) * d_model ** -0.5
    gate, up = (jax.random.normal(k, (experts, d_model, d_ff)) * d_model ** -0.5
                for k in keys[2:4])
    down = jax.random.normal(keys[4], (experts, d_ff, d_model)) * d_ff ** -0.5
    return x, router, ExpertWeights(gate=gate, up=up, down=down)


def moe_runner(args, experts: int, k: int, implementation: str,
               capacity_factor: float | None, block_size: int = 128, options="train"):
    """A compiled forward+backward of `moe` on fixed inputs."""
    x, router, weights = _inputs(args.tokens, args.d_model, args.d_ff, experts)

    def loss(x, router, weights):
        out, _ = moe(x, router, weights, num_selected=k, capacity_factor=capacity_factor,
                     implementation=implementation, block_size=block_size)
        return jnp.sum(out)

    options = compiler_options(has_experts=True) if options == "train" else options
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), compiler_options=options)
    return lambda: jax.block_until_ready(step(x, router, weights))


def dense_runner(args, hidden: int, options="train"):
    """A compiled forward+backward of a SwiGLU MLP down(silu(x gate) * x up) with `hidden`
    units."""
    x, _, weights = _inputs(args.tokens, args.d_model, hidden, 1)
    params = (weights.gate[0], weights.up[0], weights.down[0])

    def loss(x, params):
        gate, up, down = params
        return jnp.sum((jax.nn.silu(x @ gate) * (x @ up)) @ down)

    options = compiler_options(has_experts=False) if options == "train" else options
    step = jax.jit(jax.grad(loss, argnums=(0, 1)), compiler_options=options)
    return lambda: jax.block_until_ready(step(x, params))


def products_runners(args, experts: int, k: int, options) -> tuple[dict, float]:
    """One expert projection [d_model -> d_ff] forward and backward (the gradients of rows and
    weights): tfx's grouped matmul on the sorted, padded rows of the layer's real routing,
    and one dense matmul over the same tokens · k rows. Returns the two runners and the
    padding (rows multiplied / assignments)."""
    x, router, weights = _inputs(args.tokens, args.d_model, args.d_ff, experts)
    routing = route(router_logits(x, router), num_selected=k)
    rows, _, block_expert, used = block_layout(x, routing, experts, BLOCK)
    padding = float(used) * BLOCK / (args.tokens * k)
    assigned = jnp.repeat(x, k, axis=0)

    def grouped(rows, matrices):
        return jnp.sum(jnp.tanh(grouped_matmul(rows, matrices, block_expert, used)))

    def dense(rows, matrix):
        return jnp.sum(jnp.tanh(rows @ matrix))

    runners = {}
    for name, loss, inputs in (("grouped", grouped, (rows, weights.up)),
                               ("dense", dense, (assigned, weights.up[0]))):
        step = jax.jit(jax.grad(loss, argnums=(0, 1)), compiler_options=options)
        runners[name] = lambda step=step, inputs=inputs: jax.block_until_ready(step(*inputs))
    return runners, padding


def products_table(args) -> list[dict]:
    """Where the MoE layer's time goes beyond padding: the grouped matmul against one dense
    matmul over the same rows, at each E (largest k), under both compiler option sets."""
    k, rows = max(args.k), []
    for experts in args.experts:
        for label, options in (("XLA default", None), ("no YNNPACK", NO_YNN)):
            runners, padding = products_runners(args, experts, k, options)
            ms = interleaved_ms(runners, args.repeats)
            rows.append({"experts": experts, "k": k, "compiler_options": label,
                         "padding": padding, "grouped_ms": ms["grouped"],
                         "dense_ms": ms["dense"]})
            print(f"E={experts} k={k} {label:11s} padding {padding:.3f}  grouped "
                  f"{ms['grouped']:7.1f} ms  dense {ms['dense']:7.1f} ms", flush=True)
    return rows


def interleaved_ms(runners: dict, repeats: int) -> dict:
    """Median milliseconds of each runner: one warmup call each (compilation), then `repeats`
    rounds that call every runner once, the order reversed every other round, so that the load
    of this shared machine falls on all of them alike."""
    for run in runners.values():
        run()
    times = {name: [] for name in runners}
    names = list(runners)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main_table(args) -> list[dict]:
    rows = []
    for experts in args.experts:
        for k in args.k:
            runners = {"dense": dense_runner(args, args.d_ff * k),
                       "sorted_dropless": moe_runner(args, experts, k, "sorted", None),
                       "sorted_cf": moe_runner(args, experts, k, "sorted", CAPACITY_FACTOR),
                       "onehot_cf": moe_runner(args, experts, k, "onehot", CAPACITY_FACTOR)}
            if experts <= args.ragged_max_experts:
                runners["ragged_dropless"] = moe_runner(args, experts, k, "ragged", None)
            row = {"experts": experts, "k": k, "dense_hidden": args.d_ff * k}
            row.update({f"{name}_ms": ms
                        for name, ms in interleaved_ms(runners, args.repeats).items()})
            row.setdefault("ragged_dropless_ms", None)
            rows.append(row)
            print(f"E={experts:3d} k={k}  " + "  ".join(
                f"{key[:-3]} {value:8.1f} ms" for key, value in row.items()
                if key.endswith("_ms") and value is not None), flush=True)
    return rows


def options_table(args) -> list[dict]:
    """At the largest E and k: the dense MLP and sorted dropless (several block sizes) compiled
    without YNNPACK fusions and with XLA's default CPU options (YNNPACK fusions on)."""
    experts, k = max(args.experts), max(args.k)
    runners = {}
    for label, options in (("no YNNPACK", NO_YNN), ("XLA default", None)):
        runners[("dense", None, label)] = dense_runner(args, args.d_ff * k, options)
        for block_size in args.block_sizes:
            runners[("sorted_dropless", block_size, label)] = moe_runner(
                args, experts, k, "sorted", None, block_size, options)
    rows = []
    for (name, block_size, label), ms in interleaved_ms(runners, args.repeats).items():
        rows.append({"experts": experts, "k": k, "implementation": name,
                     "block_size": block_size, "compiler_options": label, "ms": ms})
        print(f"E={experts} k={k} {name:15s} block {block_size!s:4s} {label:11s} "
              f"{ms:8.1f} ms", flush=True)
    return rows


def _ratio(ours, theirs):
    return None if ours is None or theirs is None else ours / theirs


def summary(rows: list[dict]) -> dict:
    """The headline ratios, keyed by name (at E = 64, k = 2) and by name_E{E}_k{k}."""
    out = {}
    for row in rows:
        tag = f"E{row['experts']}_k{row['k']}"
        out[f"sorted_vs_onehot_{tag}"] = _ratio(row["sorted_cf_ms"], row["onehot_cf_ms"])
        out[f"moe_vs_dense_active_{tag}"] = _ratio(row["sorted_dropless_ms"], row["dense_ms"])
        out.setdefault("ragged_dot", {})[tag] = _ratio(row["ragged_dropless_ms"],
                                                       row["sorted_dropless_ms"])
    for name in ("sorted_vs_onehot", "moe_vs_dense_active"):
        out[name] = out.get(f"{name}_E64_k2")
    return out


def options_summary(rows: list[dict]) -> dict:
    """sorted dropless (block 128) / dense under each option set."""
    ms = {(r["implementation"], r["block_size"], r["compiler_options"]): r["ms"] for r in rows}
    out = {}
    for options, key in (("no YNNPACK", "no_ynnpack"), ("XLA default", "xla_default")):
        if ("sorted_dropless", 128, options) in ms:
            out[f"moe_vs_dense_active_{key}_options"] = (ms[("sorted_dropless", 128, options)]
                                                         / ms[("dense", None, options)])
    return out


def render(results: dict) -> str:
    c = results["config"]
    lines = [f"Command: `{results['command']}` at revision `{results['revision']}` "
             f"({results['date']}); jax {results['jax']}, {results['cpus']} CPUs (shared: "
             f"expect noise); each layer compiled with the options tfx's training step uses "
             "for it: XLA's defaults for MoE, no YNNPACK fusions for the dense MLP."]
    if results.get("rows"):  # absent when run with --skip main
        lines += _main_section(results)
    if results.get("options"):
        rows = results["options"]
        dense = {r["compiler_options"]: r["ms"] for r in rows if r["implementation"] == "dense"}
        lines += ["", f"## Compiler options and block size, E = {rows[0]['experts']}, "
                  f"k = {rows[0]['k']}, forward+backward (ms)", "",
                  "no YNNPACK: `xla_cpu_experimental_ynn_fusion_type=\"\"` (what "
                  "tfx.train.step compiles dense models with); XLA default: YNNPACK fusions "
                  "on (models with experts). "
                  "Ratio: to the dense MLP under the same options. Load average (1 min) "
                  f"{results['options_load'][0]:.1f} before, {results['options_load'][1]:.1f} "
                  "after.", "",
                  markdown_table(["implementation", "block_size", "compiler options", "ms",
                                  "/ dense (same options)"],
                                 [[r["implementation"], r["block_size"], r["compiler_options"],
                                   r["ms"], r["ms"] / dense[r["compiler_options"]]]
                                  for r in rows])]
    if results.get("products"):
        lines += ["", "## One expert projection, forward+backward: grouped vs dense matmul (ms)",
                  "", f"x [{c['tokens']} tokens · k, {c['d_model']}] times [{c['d_model']}, "
                  f"{c['d_ff']}] and the gradients of both, summed through tanh: tfx's "
                  "`grouped_matmul` on the layer's sorted rows (routing of the benchmark's "
                  f"router, groups padded to {BLOCK}-row blocks) against one dense matmul over the "
                  "same tokens · k rows. padding: rows multiplied / assignments. block cost: "
                  "grouped / (dense · padding), what the block loop costs per row beyond the "
                  "padding.", "",
                  markdown_table(["E", "k", "compiler options", "padding", "grouped", "dense",
                                  "grouped / dense", "block cost"],
                                 [[r["experts"], r["k"], r["compiler_options"], r["padding"],
                                   r["grouped_ms"], r["dense_ms"],
                                   r["grouped_ms"] / r["dense_ms"],
                                   r["grouped_ms"] / (r["dense_ms"] * r["padding"])]
                                  for r in results["products"]])]
    return "\n".join(lines) + "\n"


def _main_section(results: dict) -> list[str]:
    """The E x k table and its headline (GOALS)."""
    c, s = results["config"], results
    lines = ["", f"## MoE layer forward+backward, {c['tokens']} tokens, d_model {c['d_model']}, "
             f"expert d_ff {c['d_ff']}, SwiGLU, float32 (ms)", "",
             f"Medians of {c['repeats']} calls after a warmup (compilation excluded), the "
             "implementations of one row called in alternation; load average (1 min) "
             f"{results['load_before']:.1f} before, {results['load_after']:.1f} after; "
             "grad of sum(output) w.r.t. x, router kernel and all weights. MoE times include "
             "the router. dense: SwiGLU MLP with d_ff·k hidden units (the same active "
             f"parameters per token). cf: capacity factor {CAPACITY_FACTOR}, the same routing "
             "for sorted and onehot. ragged (`jax.lax.ragged_dot`) computes every expert on "
             f"every row on CPU: run only at E <= {c['ragged_max_experts']}, \"-\" elsewhere "
             "(a separate measurement: about 97 s per step at E = 64, k = 2).", "",
             markdown_table(["E", "k", "dense (d_ff·k)", "sorted dropless", "sorted cf",
                             "onehot cf", "ragged dropless", "sorted/onehot (cf)",
                             "sorted dropless/dense", "ragged/sorted (dropless)"],
                            [[r["experts"], r["k"], r["dense_ms"], r["sorted_dropless_ms"],
                              r["sorted_cf_ms"], r["onehot_cf_ms"], r["ragged_dropless_ms"],
                              _ratio(r["sorted_cf_ms"], r["onehot_cf_ms"]),
                              _ratio(r["sorted_dropless_ms"], r["dense_ms"]),
                              _ratio(r["ragged_dropless_ms"], r["sorted_dropless_ms"])]
                             for r in results["rows"]])]
    lines += ["", f"Headline (E = 64, k = 2): sorted/onehot = {_fmt(s['sorted_vs_onehot'])} "
              f"(goal <= {GOALS['sorted_vs_onehot']}), MoE (sorted, dropless)/dense = "
              f"{_fmt(s['moe_vs_dense_active'])} (goal <= {GOALS['moe_vs_dense_active']})."]
    if "moe_vs_dense_active_xla_default_options" in results:
        lines[-1] += (" Measured again below (block 128): MoE/dense "
                      f"{_fmt(results['moe_vs_dense_active_no_ynnpack_options'])} with both "
                      "compiled without YNNPACK fusions, "
                      f"{_fmt(results['moe_vs_dense_active_xla_default_options'])} with XLA's "
                      "default options.")
    return lines


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def main() -> None:
    keep_freed_memory()  # as the tfx command does, before JAX starts
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--experts", type=ints, default=[8, 64])
    parser.add_argument("--k", type=ints, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ragged-max-experts", type=int, default=8,
                        help="run ragged_dot only up to this many experts (CPU: E x the work)")
    parser.add_argument("--block-sizes", type=ints, default=[64, 128, 256],
                        help="block sizes of the sorted dispatch in the options section")
    parser.add_argument("--quick", action="store_true",
                        help="1024 tokens, d_model 128, d_ff 256, 2 repeats, no options section")
    parser.add_argument("--skip", type=lambda v: v.split(","), default=[],
                        help="sections to skip: main,options,products")
    parser.add_argument("--update", help="start from this results JSON (sections measured now "
                                         "replace its own)")
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--markdown", help="write the report to this path (default: the "
                                           "--json path with .md)")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.d_model, args.d_ff, args.repeats = 1024, 128, 256, 2
        args.block_sizes = []
    results = {**provenance("moe.py"),
               "config": {"tokens": args.tokens, "d_model": args.d_model, "d_ff": args.d_ff,
                          "capacity_factor": CAPACITY_FACTOR, "repeats": args.repeats,
                          "ragged_max_experts": args.ragged_max_experts, "dtype": "float32",
                          "activation": "silu (SwiGLU)", "goals": GOALS}}
    if args.update:
        previous = json.loads(pathlib.Path(args.update).read_text())
        for key in ("command", "revision", "date"):
            results[key] = f"{previous[key]}; then {results[key]}"
        results = {**previous, **results}
    if "main" not in args.skip:
        print("# E x k", flush=True)
        results["load_before"] = os.getloadavg()[0]
        results["rows"] = main_table(args)
        results["load_after"] = os.getloadavg()[0]
        results.update(summary(results["rows"]))
        write_json(args.json, results)  # keep the main table if the options section fails
    if args.block_sizes and "options" not in args.skip:
        print("\n# compiler options and block sizes", flush=True)
        load_before = os.getloadavg()[0]
        results["options"] = options_table(args)
        results["options_load"] = [load_before, os.getloadavg()[0]]
        results.update(options_summary(results["options"]))
    if "products" not in args.skip:
        print("\n# one projection: grouped vs dense matmul", flush=True)
        results["products"] = products_table(args)
    markdown = args.markdown or (args.json[:-5] + ".md" if args.json and
                                 args.json.endswith(".json") else None)
    publish(render(results), results, json_path=args.json, markdown_path=markdown)


if __name__ == "__main__":
    main()
