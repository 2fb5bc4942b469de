"""The blocked kernel's tile sizes: measured time per visited pair, and what the choice picks.

    python benchmarks/tile_sizes.py                   # ten cases, 4 tile sizes each, 3 repeats
    python benchmarks/tile_sizes.py --quick           # two small cases, 1 repeat: a smoke run
    python benchmarks/tile_sizes.py --json benchmarks/results/tile_sizes.json  # also the .md

Each case (a static mask, N, forward or forward+backward; 8 heads of 64, float32, batch 1) runs
`tfx.ops.dot_product_attention(implementation="blocked")` on every tile size of `SIZES`, forced
with `block_sizes`. A row gives the median time, the pairs the kernel visits (visited tiles x
tile size, from the mask's exact block layout), the time per visited pair, and that time
relative to the default 256 x 512 tiles: the numbers
`tfx.ops.attention.tile_sizes.PAIR_COST` is read from. The last columns say which size was
fastest and which one `choose_block_sizes` picks.
"""

from __future__ import annotations

import argparse
import statistics

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

from tfx.ops import dot_product_attention, sparse
from tfx.ops.attention.tile_sizes import choose_block_sizes

HEADS, HEAD_DIM = 8, 64
SIZES = ((256, 512), (128, 256), (128, 128), (64, 64))
PATTERNS = {
    "causal": sparse.Causal(),
    "window 256": sparse.SlidingWindow(256),
    "window 1024": sparse.SlidingWindow(1024),
    "strided 128": sparse.Strided(128),
    "bigbird": sparse.SlidingWindow(192) | sparse.GlobalTokens(64) | sparse.RandomBlocks(64, 3),
}
# (pattern, N, forward+backward?)
CASES = ([("causal", n, False) for n in (1024, 2048, 4096)]
         + [("causal", n, True) for n in (1024, 2048, 4096)]
         + [(name, 8192, False) for name in ("bigbird", "strided 128", "window 256",
                                             "window 1024")])
QUICK_CASES = [("causal", 1024, False), ("bigbird", 1024, False)]


def _runner(spec, n: int, backward: bool, block_sizes: tuple[int, int]):
    keys = jax.random.split(jax.random.key(0), 3)
    inputs = [jax.random.normal(k, (1, n, HEADS, HEAD_DIM)) for k in keys]

    def attend(q, k, v):
        return dot_product_attention(q, k, v, sparsity=spec, implementation="blocked",
                                     block_sizes=block_sizes)

    step = jax.jit(jax.grad(lambda *x: jnp.sum(attend(*x)), argnums=(0, 1, 2)) if backward
                   else attend)
    return lambda: jax.block_until_ready(step(*inputs))


def measure_case(name: str, n: int, backward: bool, repeats: int) -> dict:
    spec = PATTERNS[name]
    rows = {}
    for block_q, block_k in SIZES:
        seconds = median_seconds(_runner(spec, n, backward, (block_q, block_k)), repeats=repeats)
        pairs = int(spec.block_layout(n, n, block_q, block_k).sum()) * block_q * block_k
        rows[f"{block_q}x{block_k}"] = {"ms": 1e3 * seconds, "visited_pairs": pairs,
                                        "ns_per_pair": 1e9 * seconds / pairs}
    base = rows[f"{SIZES[0][0]}x{SIZES[0][1]}"]["ns_per_pair"]
    for row in rows.values():
        row["pair_cost_vs_default"] = row["ns_per_pair"] / base
    chosen = choose_block_sizes(spec, n, n)
    case = {"pattern": name, "n": n, "pass": "fwd+bwd" if backward else "fwd", "sizes": rows,
            "fastest": min(rows, key=lambda s: rows[s]["ms"]), "chosen": f"{chosen[0]}x{chosen[1]}"}
    print(f"{name:12s} N={n:5d} {case['pass']:7s} " + "  ".join(
        f"{s} {r['ms']:8.1f} ms" for s, r in rows.items())
        + f"  fastest {case['fastest']}, chosen {case['chosen']}", flush=True)
    return case


def render(results: dict) -> str:
    sizes = [f"{q}x{k}" for q, k in SIZES]
    rows = [[c["pattern"], c["n"], c["pass"],
             *[c["sizes"][s]["ms"] for s in sizes],
             *[c["sizes"][s]["pair_cost_vs_default"] for s in sizes[1:]],
             c["fastest"], c["chosen"]] for c in results["cases"]]
    costs = {s: statistics.median(c["sizes"][s]["pair_cost_vs_default"] for c in results["cases"])
             for s in sizes[1:]}
    return "\n".join([
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, {results['cpus']} CPUs.", "",
        f"## Blocked attention by tile size, batch 1, {HEADS} heads of {HEAD_DIM}, float32", "",
        "Medians of the repeats (ms); time per visited pair relative to 256x512 tiles.", "",
        markdown_table(["pattern", "N", "pass", *[f"{s} ms" for s in sizes],
                        *[f"{s} / 256x512 per pair" for s in sizes[1:]], "fastest", "chosen"],
                       rows), "",
        "Median time per visited pair relative to 256x512: "
        + ", ".join(f"{s} {v:.2f}" for s, v in costs.items()) + "."]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="two 1024-token cases, 1 repeat")
    add_output_arguments(parser)
    args = parser.parse_args()
    cases, repeats = (QUICK_CASES, 1) if args.quick else (CASES, args.repeats)
    results = provenance("tile_sizes.py")
    results["cases"] = [measure_case(*case, repeats) for case in cases]
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
