"""Context-parallel (ring / all-gather) attention on 8 simulated CPU devices vs one device.

    python benchmarks/context_parallel.py                       # N = 4096..16384
    python benchmarks/context_parallel.py --quick               # N = 4096 only, 2 repeats
    python benchmarks/context_parallel.py --json results/context_parallel.json

Causal self-attention [batch=1, N, heads=8, head_dim=64], float32, forward+backward (grad of
the output's sum w.r.t. q, k, v). Peer: `tfx.ops.dot_product_attention(implementation=
"blocked")` on one device at the same total length. Each context-parallel row splits the
sequence over a ring of n of the 8 devices (`make_mesh(data=1, sequence=n)` over the first n;
zigzag chunks, tiles of the same blocked kernel). Per-device memory is XLA's compiled
temporary buffers plus the arguments each device holds (`memory_analysis()`), not a resident
set: the simulated devices share one process.

The 8 devices are XLA's host-platform simulation (`--xla_force_host_platform_device_count`):
they share this machine's cores, so a ring of n does not run n times faster; the time column
measures what splitting costs (the ppermutes, the zigzag reorder, per-chunk tiles) on top of
the same work, and the memory column is what a real ring of n devices would hold each.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse

import jax
import jax.numpy as jnp
from timing import (
    add_output_arguments,
    markdown_path,
    markdown_table,
    median_seconds,
    provenance,
    publish,
)

from tfx.ops import dot_product_attention
from tfx.ops.attention.context_parallel import context_parallel_attention
from tfx.ops.sparse import Causal
from tfx.parallel import make_mesh

HEADS, HEAD_DIM = 8, 64
RINGS = (2, 4, 8)


def _step(attend):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2)))


def _measure(step, inputs, repeats: int) -> tuple[float, float]:
    """(median seconds of a forward+backward, per-device MiB: temporaries + arguments)."""
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in inputs]
    memory = step.lower(*shapes).compile().memory_analysis()
    devices = len(inputs[0].sharding.device_set)
    per_device = memory.temp_size_in_bytes + memory.argument_size_in_bytes / devices
    seconds = median_seconds(lambda: jax.block_until_ready(step(*inputs)), repeats=repeats)
    return seconds, per_device / 2**20


def measure(n: int, repeats: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 3)
    inputs = [jax.random.normal(k, (1, n, HEADS, HEAD_DIM), jnp.float32) for k in keys]
    single = _step(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True,
                                                         implementation="blocked"))
    seconds, mib = _measure(single, inputs, repeats)
    rows = [{"n": n, "devices": 1, "exchange": "one device (blocked)", "seconds": seconds,
             "mib_per_device": mib}]
    for devices in RINGS:
        mesh = make_mesh(data=1, sequence=devices, devices=jax.devices()[:devices])
        placed = [jax.device_put(x, jax.NamedSharding(mesh, jax.P(None, "sequence")))
                  for x in inputs]
        for exchange in ("ring", "all_gather"):
            step = _step(lambda q, k, v, mesh=mesh, exchange=exchange:
                         context_parallel_attention(q, k, v, mesh=mesh, spec=Causal(),
                                                    exchange=exchange))
            with jax.set_mesh(mesh):
                seconds, mib = _measure(step, placed, repeats)
            rows.append({"n": n, "devices": devices, "exchange": exchange, "seconds": seconds,
                         "mib_per_device": mib})
        print(n, devices, rows[-2:], flush=True)
    return rows


def render(results: dict) -> str:
    rows = results["rows"]
    single = {r["n"]: r for r in rows if r["devices"] == 1}
    table = markdown_table(
        ["N", "devices", "exchange", "ms", "time / one device", "MiB per device",
         "memory / one device"],
        [[r["n"], r["devices"], r["exchange"], r["seconds"] * 1e3,
          r["seconds"] / single[r["n"]]["seconds"], r["mib_per_device"],
          r["mib_per_device"] / single[r["n"]]["mib_per_device"]] for r in rows])
    return "\n".join([
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, {results['cpus']} CPUs, "
        f"XLA_FLAGS `{results['xla_flags']}`.",
        "",
        f"## Causal attention forward+backward, batch 1, {HEADS} heads x {HEAD_DIM}, float32",
        "",
        f"Medians of {results['repeats']} calls after a warmup. The simulated devices share "
        "the machine's cores: time / one device is the cost of splitting the same work, not a "
        "speed-up; MiB per device is what each device of a real ring holds (compiled "
        "temporaries + its arguments).",
        "",
        table, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="N = 4096 only, 2 repeats")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.repeats = [4096], 2
    rows = [row for n in args.lengths for row in measure(n, args.repeats)]
    results = {**provenance("context_parallel.py"), "repeats": args.repeats, "rows": rows}
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
