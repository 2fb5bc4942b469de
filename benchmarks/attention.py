"""Attention speed and memory: tfx (blocked) vs jax.nn.dot_product_attention vs torch SDPA.

    python benchmarks/attention.py                      # the full tables (tens of minutes)
    python benchmarks/attention.py --quick              # N = 512..2048, float32, a few minutes
    python benchmarks/attention.py --json r.json --markdown r.md   # keep the numbers

Layout [batch=1, N, heads=8, head_dim=64]. Times are medians of --repeats runs in this process,
on the same inputs; ratios are tfx / peer (below 1 = tfx faster). Peers that would exceed
--peer-budget seconds per call (estimated from the previous size) are skipped and marked "–".
Peak memory of forward+backward is measured in a child process per (implementation, N) as the
growth of its peak resident set. Sparse patterns are compared with the same kernel given the
same mask as a dense boolean array (no tile skipping) and with the ideal ratio: the fraction of
(query, key) pairs the pattern keeps.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from timing import (
    markdown_table,
    median_seconds,
    peak_rss_growth_mib,
    provenance,
    publish,
    run_child,
    write_json,
)

from tfx.ops import dot_product_attention, sparse
from tfx.ops.attention.blocked_attention import BLOCK_K, BLOCK_Q
from tfx.ops.attention.tile_sizes import choose_pieces
from tfx.train.host_memory import keep_freed_memory

HEADS, HEAD_DIM = 8, 64
DEFAULT_TILES = (BLOCK_Q, BLOCK_K)
PATTERNS = {
    "sliding window 256": sparse.SlidingWindow(256),
    "sliding window 1024": sparse.SlidingWindow(1024),
    "strided 128": sparse.Strided(128),
    "bigbird (window 192, 64 global, 3x64 random)": sparse.SlidingWindow(192)
    | sparse.GlobalTokens(64) | sparse.RandomBlocks(64, 3),
}


def _inputs(n: int, dtype: str):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (1, n, HEADS, HEAD_DIM), jnp.dtype(dtype)) for k in keys]


def _jax_runner(attend, inputs, backward: bool):
    """A compiled forward (or forward+backward) of `attend(q, k, v)` on fixed inputs."""
    if backward:
        step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)),
                                argnums=(0, 1, 2)))
    else:
        step = jax.jit(attend)
    return lambda: jax.block_until_ready(step(*inputs))


def _torch_runner(inputs, causal: bool, backward: bool):
    import torch

    q, k, v = (torch.from_numpy(np.array(x.astype(jnp.float32))).to(_torch_dtype(x.dtype))
               .transpose(1, 2).contiguous().requires_grad_(backward) for x in inputs)

    def run():
        with torch.set_grad_enabled(backward):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if backward:
                out.float().sum().backward()

    return run


def _torch_dtype(dtype):
    import torch

    return {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16}[jnp.dtype(dtype).type]


def _tfx(causal: bool):
    return lambda q, k, v: dot_product_attention(q, k, v, is_causal=causal,
                                                 implementation="blocked")


def _jax_nn(causal: bool):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)


def dense_table(args) -> list[dict]:
    rows = []
    for dtype in args.dtypes:
        for causal in (True, False):
            for backward in (False, True):
                estimate = {"jax.nn": 0.0, "torch": 0.0}
                for n in args.sizes:
                    inputs = _inputs(n, dtype)
                    row = {"dtype": dtype, "causal": causal, "n": n,
                           "pass": "fwd+bwd" if backward else "fwd"}
                    row["tfx_ms"] = 1e3 * median_seconds(
                        _jax_runner(_tfx(causal), inputs, backward), repeats=args.repeats)
                    peers = {"jax.nn": functools.partial(_jax_runner, _jax_nn(causal), inputs,
                                                         backward)}
                    if args.torch:
                        peers["torch"] = functools.partial(_torch_runner, inputs, causal,
                                                           backward)
                    # jax.nn holds several [heads, N, N] float32 buffers (scores, probabilities,
                    # their gradients): 16384 needs over 24 GiB even for the forward pass.
                    too_big = HEADS * n * n * 4 * (4 if backward else 3) > 12 * 2**30
                    for name, make in peers.items():
                        if estimate[name] > args.peer_budget or (name == "jax.nn" and too_big):
                            row[f"{name}_ms"] = None
                            continue
                        seconds = median_seconds(make(), repeats=args.repeats)
                        row[f"{name}_ms"] = 1e3 * seconds
                        estimate[name] = seconds * 4  # attention is quadratic in N
                    rows.append(row)
                    print(_dense_line(row), flush=True)
    return rows


def _dense_line(row: dict) -> str:
    parts = [f"{row['dtype']:8s} causal={row['causal']!s:5s} N={row['n']:5d} {row['pass']:7s}",
             f"tfx {row['tfx_ms']:8.1f} ms"]
    for peer in ("jax.nn", "torch"):
        peer_ms = row.get(f"{peer}_ms")
        if peer_ms:
            parts.append(f"{peer} {peer_ms:8.1f} ms (x{row['tfx_ms'] / peer_ms:.2f})")
    return "  ".join(parts)


def memory_child(implementation: str, n: int) -> None:
    """Child process: memory that one float32 causal forward+backward allocates beyond its
    inputs, printed as JSON.

    JAX: XLA's accounting of the compiled step (outputs + scratch); a resident-set reading would
    mostly show the compiler. torch: growth of the peak resident set over the step.
    """
    inputs = _inputs(n, "float32")
    if implementation == "torch":
        peak = peak_rss_growth_mib(_torch_runner(inputs, True, True))
    else:
        attend = _tfx(True) if implementation == "tfx" else _jax_nn(True)
        step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2)))
        stats = step.lower(*inputs).compile().memory_analysis()
        peak = (stats.output_size_in_bytes + stats.temp_size_in_bytes) / 2**20
    print(json.dumps({"peak_mib": round(peak, 1)}))


def memory_table(args) -> list[dict]:
    rows = []
    for n in args.sizes:
        row = {"n": n}
        for implementation in ("tfx", "jax.nn", "torch") if args.torch else ("tfx", "jax.nn"):
            # jax.nn holds [heads, N, N] float32 scores and their gradient: stop before 16 GiB.
            if implementation == "jax.nn" and 2 * HEADS * n * n * 4 > 16 * 2**30:
                row["jax.nn_mib"] = None
                continue
            child = run_child([__file__, "--memory-child", implementation, str(n)])
            row[f"{implementation}_mib"] = child["peak_mib"]
        rows.append(row)
        print(f"N={n:5d} peak MiB of causal fwd+bwd: "
              + ", ".join(f"{k[:-4]} {v}" for k, v in row.items() if k != "n"), flush=True)
    return rows


def sparse_table(args) -> list[dict]:
    rows = []
    for name, spec in PATTERNS.items():
        for n in args.sparse_sizes:
            inputs = _inputs(n, "float32")
            dense_mask = spec.dense(n, n)
            row = {"pattern": name, "n": n, "ideal_ratio": float(np.mean(dense_mask)),
                   "tiles": _pieces(choose_pieces(spec, n, n))}
            row["sparse_ms"] = _forward_ms(args, inputs, sparsity=spec, implementation="blocked")
            # The same pattern on the fixed default tiles, as before the tile choice.
            row["sparse_default_tiles_ms"] = _forward_ms(
                args, inputs, sparsity=spec, implementation="blocked", block_sizes=DEFAULT_TILES)
            row["full_ms"] = _forward_ms(args, inputs, implementation="blocked")
            # jax.nn with the mask holds [heads, N, N] float32 scores: stop before 8 GiB.
            row["jax.nn_mask_ms"] = None
            if HEADS * n * n * 4 < 8 * 2**30:
                mask = jnp.asarray(dense_mask)[None, None]
                row["jax.nn_mask_ms"] = 1e3 * median_seconds(_jax_runner(
                    lambda q, k, v, m=mask: jax.nn.dot_product_attention(q, k, v, mask=m),
                    inputs, False), repeats=args.repeats)
            rows.append(row)
            print(f"{name:45s} N={n:5d} sparse {row['sparse_ms']:8.1f} ms (tiles {row['tiles']}; "
                  f"{row['sparse_default_tiles_ms']:8.1f} ms on {DEFAULT_TILES})  full "
                  f"{row['full_ms']:8.1f} ms  jax.nn+mask {row['jax.nn_mask_ms']} ms  "
                  f"kept {row['ideal_ratio']:.3f}", flush=True)
    return rows


def _forward_ms(args, inputs, **kwargs) -> float:
    attend = lambda q, k, v: dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    return 1e3 * median_seconds(_jax_runner(attend, inputs, False), repeats=args.repeats)


def render(results: dict) -> str:
    """The markdown report of a results dict (as written by --json)."""
    lines = [f"Commands: `{results['command']}` at revisions `{results['revision']}` "
             f"({results['date']}); jax {results['jax']}, torch {results.get('torch', '-')}, "
             f"{results['cpus']} CPUs. Ratios are tfx / peer: below 1 means tfx is faster."]
    if "dense" in results:
        lines += ["", "## Dense attention, batch 1, 8 heads, head_dim 64 (ms)", "",
                  markdown_table(["dtype", "causal", "N", "pass", "tfx", "jax.nn", "tfx/jax.nn",
                                  "torch", "tfx/torch"],
                                 [[r["dtype"], r["causal"], r["n"], r["pass"], r["tfx_ms"],
                                   r["jax.nn_ms"], _ratio(r["tfx_ms"], r["jax.nn_ms"]),
                                   r.get("torch_ms"), _ratio(r["tfx_ms"], r.get("torch_ms"))]
                                  for r in results["dense"]])]
    if "memory" in results:
        lines += ["", "## Peak memory of a causal forward+backward, float32 (MiB)", "",
                  "Memory allocated beyond the inputs. JAX columns: XLA's accounting of the "
                  "compiled step (outputs and scratch); torch: growth of the peak resident set "
                  "over the step.", "",
                  markdown_table(["N", "tfx", "jax.nn", "torch"],
                                 [[r["n"], r["tfx_mib"], r["jax.nn_mib"], r.get("torch_mib")]
                                  for r in results["memory"]])]
    if "sparse" in results:
        lines += ["", "## Sparse patterns, forward, float32 (ms)", "",
                  "tfx sparse runs the passes and tiles "
                  "`tfx.ops.attention.tile_sizes.choose_pieces` chooses (column tiles: a "
                  "strided pattern's strided pairs run in residue order); the column before "
                  "it, one pass on the fixed "
                  f"{DEFAULT_TILES[0]} x {DEFAULT_TILES[1]} tiles. Goal (issue 22): sparse/full "
                  "<= 2 x ideal + 0.02.", "",
                  markdown_table(["pattern", "N", "tiles", f"tfx sparse, {DEFAULT_TILES}",
                                  "tfx sparse", "tfx full", "sparse/full", "ideal (pairs kept)",
                                  "goal", "jax.nn + mask", "sparse/jax.nn"],
                                 [[r["pattern"], r["n"], _tiles(r),
                                   r.get("sparse_default_tiles_ms"), r["sparse_ms"], r["full_ms"],
                                   r["sparse_ms"] / r["full_ms"], r["ideal_ratio"],
                                   2 * r["ideal_ratio"] + 0.02, r["jax.nn_mask_ms"],
                                   _ratio(r["sparse_ms"], r["jax.nn_mask_ms"])]
                                  for r in results["sparse"]])]
    return "\n".join(lines) + "\n"


def _tiles(row: dict) -> str:
    """A row's chosen passes and tiles (rows measured before the tile choice ran on one pass
    of 256 x 512; rows before the pieces hold [block_q, block_k])."""
    tiles = row.get("tiles", DEFAULT_TILES)
    return tiles if isinstance(tiles, str) else " x ".join(map(str, tiles))


def _pieces(pieces) -> str:
    """The blocked kernel's passes, e.g. "64 x 64 + 64 x 64 in residue order mod 128"."""
    return " + ".join(f"{p.block_q} x {p.block_k}"
                      + (f" in residue order mod {p.stride}" if p.stride > 1 else "")
                      for p in pieces)


def _ratio(ours, theirs):
    return None if ours is None or theirs is None else ours / theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--sparse-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[8192, 16384])
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peer-budget", type=float, default=30.0,
                        help="skip a peer whose estimated seconds per call exceed this")
    parser.add_argument("--quick", action="store_true", help="N = 512..2048, float32 only")
    parser.add_argument("--skip", type=lambda s: s.split(","), default=[],
                        help="sections to skip: dense,memory,sparse")
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--markdown", help="write the report to this path")
    parser.add_argument("--update", help="start from this results JSON: the sections measured "
                                         "now replace its own, the others are kept")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], int(args.memory_child[1]))
        return
    keep_freed_memory()  # as the tfx command does, before JAX starts (not in memory children)
    if args.quick:
        args.sizes, args.sparse_sizes, args.dtypes = [512, 1024, 2048], [4096], ["float32"]
    results = provenance("attention.py")
    if args.update:
        previous = json.loads(pathlib.Path(args.update).read_text())
        for key in ("command", "revision", "date"):
            results[key] = f"{previous[key]}; then {results[key]}"
        results = {**previous, **results}
    try:
        import torch

        results["torch"], args.torch = torch.__version__, True
    except ImportError:
        print("torch not installed (pip install -e '.[bench]'): torch columns are skipped")
        args.torch = False
    sections = {"dense": dense_table, "memory": memory_table, "sparse": sparse_table}
    for name, measure in sections.items():
        if name not in args.skip:
            print(f"\n# {name}", flush=True)
            results[name] = measure(args)
            write_json(args.json, results)  # keep what is measured if a later section fails
    publish(render(results), results, json_path=args.json, markdown_path=args.markdown)


if __name__ == "__main__":
    main()
