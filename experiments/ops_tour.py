"""A short tour of tfx's pure attention and positional-encoding ops.

    python experiments/ops_tour.py [--out DIR]

Checks each op against its reference on random inputs, prints what it found, and draws the
sparse attention patterns to DIR/sparse_patterns.png (default: experiments/results/).
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from tfx.ops import dot_product_attention, positional, sparse

PATTERNS = {
    "Causal()": sparse.Causal(),
    "SlidingWindow(8)": sparse.SlidingWindow(8),
    "Strided(6)": sparse.Strided(6),
    "Fixed(8, 2)": sparse.Fixed(8, 2),
    "GlobalTokens(3) | SlidingWindow(5)": sparse.GlobalTokens(3) | sparse.SlidingWindow(5),
    "Causal() & (SlidingWindow(4) | RandomBlocks(8, 2))": sparse.Causal()
    & (sparse.SlidingWindow(4) | sparse.RandomBlocks(8, 2)),
}


def attention_section() -> None:
    keys = jax.random.split(jax.random.key(0), 3)
    batch, length, num_heads, head_dim = 2, 128, 8, 64
    print("attention vs jax.nn.dot_product_attention, [2, 128, 8 heads, 64], causal:")
    for name, num_kv_heads in [("MHA", 8), ("GQA", 2), ("MQA", 1)]:
        query = jax.random.normal(keys[0], (batch, length, num_heads, head_dim))
        key = jax.random.normal(keys[1], (batch, length, num_kv_heads, head_dim))
        value = jax.random.normal(keys[2], (batch, length, num_kv_heads, head_dim))
        ours = dot_product_attention(query, key, value, is_causal=True)
        theirs = jax.nn.dot_product_attention(query, key, value, is_causal=True)
        print(f"  {name} (num_kv_heads={num_kv_heads}): max |difference| = "
              f"{float(jnp.max(jnp.abs(ours - theirs))):.2e}")


def sparse_section(out: pathlib.Path) -> None:
    length = 48
    print(f"\nsparse patterns at length {length} (fraction of the score matrix computed):")
    fig, axes = plt.subplots(2, 3, figsize=(12, 8.5))
    for ax, (name, spec) in zip(axes.flat, PATTERNS.items(), strict=True):
        dense = spec.dense(length, length)
        print(f"  {name:52s} {dense.mean():6.1%}")
        ax.imshow(dense, cmap="Blues", interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    fig.suptitle("tfx.ops.sparse patterns (blue = may attend)")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "sparse_patterns.png", dpi=110)
    print(f"  drawn to {out / 'sparse_patterns.png'}")


def positional_section() -> None:
    print("\npositional encodings:")
    offsets = jnp.array([-200, -20, -8, -1, 0, 1, 8, 20, 128])
    buckets = positional.t5_relative_position_bucket(offsets)
    print("  T5 buckets of offsets", offsets.tolist(), "->", buckets.tolist())
    print("  ALiBi slopes, 12 heads:", np.round(np.asarray(positional.alibi_slopes(12)), 4))
    query, key = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, 64))
    inner = [
        float(jnp.sum(positional.apply_rope(query, jnp.array([m]))
                      * positional.apply_rope(key, jnp.array([m - 5]))))
        for m in (5, 50, 500)
    ]
    print("  RoPE <R_m q, R_(m-5) k> for m = 5, 50, 500:", np.round(inner, 4),
          "(depends on m - n only)")
    table = positional.sinusoidal(jnp.arange(4), 8)
    print("  sinusoidal(positions 0..3, dim 8), first rows:\n", np.round(np.asarray(table), 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    attention_section()
    sparse_section(args.out)
    positional_section()


if __name__ == "__main__":
    main()
