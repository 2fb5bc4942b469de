"""The blocked kernel's matmul floor: its tile products alone against torch's whole attention.

    python benchmarks/attention_floor.py                  # causal N = 1024..4096, both dtypes
    python benchmarks/attention_floor.py --quick          # N = 1024, float32, 1 repeat
    python benchmarks/attention_floor.py --json benchmarks/results/attention_floor.json

For causal attention over [1, N, 8 heads, 64] on the tiles `tfx.ops.attention.tile_sizes`
chooses, the plan's visited tiles are sliced and multiplied exactly as the kernel does (jit, a
loop over the tiles, dynamic slices), with nothing else: QKᵀ and PV for the forward pass, and the
five products of the backward (QKᵀ again, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q, dS·K) on top for forward+backward.
No exp, max, sum or mask. Beside it: torch.bmm on the same tiles, tfx's whole kernel and
torch's `scaled_dot_product_attention` (its CPU flash kernel). When the products alone take as
long as torch's whole attention, no reordering of the softmax passes around them closes the gap.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch
from attention import HEAD_DIM, HEADS, _inputs, _jax_runner, _tfx, _torch_runner
from timing import (
    add_output_arguments,
    markdown_path,
    markdown_table,
    median_seconds,
    provenance,
    publish,
)

from tfx.ops.attention import static_spec
from tfx.ops.attention.block_plan import block_plan
from tfx.ops.attention.tile_sizes import choose_block_sizes

FORWARD, BACKWARD = 2, 5  # tile products per visited tile


def visited_tiles(n: int) -> tuple[np.ndarray, int, int]:
    """(int32 [tiles, 2] of (query block, key block), block_q, block_k) of a causal N x N."""
    spec = static_spec(True, None)
    block_q, block_k = choose_block_sizes(spec, n, n)
    plan = block_plan(spec, n, n, block_q, block_k)
    tiles = [(qb, plan.key_blocks[qb, i]) for qb in range(len(plan.visits))
             for i in range(plan.visits[qb])]
    return np.asarray(tiles, np.int32), block_q, block_k


def _dot(pattern: str, a, b):
    return jnp.einsum(pattern, a, b, preferred_element_type=jnp.float32)


def xla_products(tiles: np.ndarray, block_q: int, block_k: int, backward: bool):
    """A jitted (q, k, v [heads, N, D]) -> float32 sum of the tile products, looping as the
    kernel does."""
    table = jnp.asarray(tiles)

    def run(q, k, v):
        def body(i, total):
            q_tile = jax.lax.dynamic_slice_in_dim(q, table[i, 0] * block_q, block_q, 1)
            k_tile, v_tile = (jax.lax.dynamic_slice_in_dim(x, table[i, 1] * block_k, block_k,
                                                           1) for x in (k, v))
            scores = _dot("hqd,hsd->hqs", q_tile, k_tile).astype(v.dtype)
            total += _dot("hqs,hsd->hqd", scores, v_tile)
            if backward:  # the backward's shapes (P and dS stand in for scores)
                d_probs = _dot("hqd,hsd->hqs", q_tile, v_tile).astype(v.dtype)
                recomputed = _dot("hqd,hsd->hqs", q_tile, k_tile).astype(v.dtype)
                total += _dot("hqs,hsd->hqd", recomputed, k_tile)
                side = _dot("hqs,hqd->hsd", scores, q_tile) + _dot("hqs,hqd->hsd", d_probs,
                                                                    q_tile)
                total += side.sum(axis=1, keepdims=True)
            return total

        init = jnp.zeros((q.shape[0], block_q, q.shape[-1]), jnp.float32)
        return jax.lax.fori_loop(0, len(tiles), body, init)

    return jax.jit(run)


def torch_products(tiles: np.ndarray, block_q: int, block_k: int, q, k, v, backward: bool):
    """The same products with torch.bmm on [heads, N, D] tensors."""
    def run():
        total = torch.zeros(q.shape[0], block_q, q.shape[-1])
        for qb, kb in tiles:
            qt = q[:, qb * block_q:(qb + 1) * block_q]
            kt, vt = (x[:, kb * block_k:(kb + 1) * block_k] for x in (k, v))
            scores = torch.bmm(qt, kt.transpose(1, 2))
            total += torch.bmm(scores, vt).float()
            if backward:
                d_probs = torch.bmm(qt, vt.transpose(1, 2))
                total += torch.bmm(torch.bmm(qt, kt.transpose(1, 2)), kt).float()
                side = torch.bmm(scores.transpose(1, 2), qt) + torch.bmm(
                    d_probs.transpose(1, 2), qt)
                total += side.float().sum(dim=1, keepdim=True)
        return total
    return run


def measure(n: int, dtype: str, backward: bool, repeats: int) -> dict:
    inputs = _inputs(n, dtype)
    tiles, block_q, block_k = visited_tiles(n)
    heads_major = [x[0].transpose(1, 0, 2) for x in inputs]  # [heads, N, D]
    products = xla_products(tiles, block_q, block_k, backward)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tensors = [torch.from_numpy(np.array(x.astype(jnp.float32))).to(torch_dtype)
               for x in heads_major]
    runs = {
        "tile_products": lambda: jax.block_until_ready(products(*heads_major)),
        "torch_bmm": torch_products(tiles, block_q, block_k, *tensors, backward),
        "tfx": _jax_runner(_tfx(True), inputs, backward),
        "torch_sdpa": _torch_runner(inputs, True, backward),
    }
    ms = {name: 1e3 * median_seconds(run, repeats=repeats) for name, run in runs.items()}
    flops = len(tiles) * HEADS * block_q * block_k * HEAD_DIM * 2 * (
        FORWARD + BACKWARD * backward)
    row = {"n": n, "dtype": dtype, "pass": "fwd+bwd" if backward else "fwd",
           "tiles": f"{len(tiles)} of {block_q} x {block_k}", **{f"{k}_ms": v
                                                                for k, v in ms.items()},
           "products_gflops": flops / ms["tile_products"] / 1e6}
    print(row, flush=True)
    return row


def report(results: dict) -> str:
    rows = [(r["dtype"], r["n"], r["pass"], r["tiles"], r["tile_products_ms"],
             r["products_gflops"], r["torch_bmm_ms"], r["tfx_ms"], r["torch_sdpa_ms"],
             r["tile_products_ms"] / r["torch_sdpa_ms"], r["tfx_ms"] / r["torch_sdpa_ms"])
            for r in results["rows"]]
    return "\n".join([
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, torch {results.get('torch')}, "
        f"{results['cpus']} CPUs.", "",
        f"## Causal attention, batch 1, {HEADS} heads of {HEAD_DIM}: the kernel's tile "
        "products alone vs whole attentions (ms)", "",
        f"Medians of {results['repeats']} runs. Products: QKᵀ and PV per visited tile "
        "(forward), five more (backward); no softmax.", "",
        markdown_table(["dtype", "N", "pass", "tiles", "tile products (XLA)", "GFLOP/s",
                        "same tiles, torch.bmm", "tfx attention", "torch SDPA",
                        "products / torch SDPA", "tfx / torch SDPA"], rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1024, 2048, 4096])
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="N = 1024, float32, 1 repeat")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.dtypes, args.repeats = [1024], ["float32"], 1
    results = {**provenance("attention_floor.py"), "repeats": args.repeats,
               "rows": [measure(n, dtype, backward, args.repeats) for dtype in args.dtypes
                        for backward in (False, True) for n in args.sizes]}
    publish(report(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
