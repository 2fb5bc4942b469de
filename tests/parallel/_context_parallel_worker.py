"""Worker for test_context_parallel.py (run as a script, 8 CPU devices): context-parallel
attention and its gradients in every CASES entry, beside single-device reference attention on
the same inputs, written to OUT.npz; the compiled step's per-device temporary memory by ring
size to OUT.json.

    python _context_parallel_worker.py OUT
"""

import os

# The test session's XLA flags (tests/conftest.py: cheaper compiles) stay.
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           + os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _context_parallel_cases import BATCH, CASES, HEAD_DIM, KEY_MASK, SEGMENTS, SEQ

from tfx.ops import dot_product_attention
from tfx.ops.attention.context_parallel import context_parallel_attention
from tfx.ops.sparse import Causal
from tfx.parallel import make_mesh


def inputs(heads, dtype):
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.normal(size=(BATCH, SEQ, h, HEAD_DIM)), dtype)
                 for h in (heads[0], heads[1], heads[1]))


def values_and_grads(attend, q, k, v):
    """attend(q, k, v) and the gradients of a weighted sum of it (every output element gets
    its own weight, so a wrong element shows in the gradients)."""
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(BATCH, SEQ, q.shape[2],
                                                                HEAD_DIM)), jnp.float32)

    def loss(q, k, v):
        out = attend(q, k, v)
        return (out.astype(jnp.float32) * weights).sum(), out

    # One compiled program for both (not a forward one and a gradient one): half the compiles.
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def run_case(axes, spec, heads, segments, key_mask, exchange, dtype):
    q, k, v = inputs(heads, dtype)
    ids = jnp.asarray(SEGMENTS) if segments else None
    mask = jnp.asarray(KEY_MASK)[:, None, None, :] if key_mask else None
    common = dict(sparsity=spec, query_segment_ids=ids, mask=mask)

    def reference(q, k, v):
        return dot_product_attention(q, k, v, implementation="reference", **common)

    mesh = make_mesh(**axes)
    with jax.set_mesh(mesh):
        if key_mask:  # the automatic path: the op picks context parallelism under the mesh
            def parallel(q, k, v):
                return dot_product_attention(q, k, v, **common)
        else:
            def parallel(q, k, v):
                return context_parallel_attention(q, k, v, mesh=mesh, spec=spec,
                                                  query_segment_ids=ids, exchange=exchange,
                                                  block_sizes=(4, 2))
        found = values_and_grads(parallel, q, k, v)
        uses_shard_map = "shard_map" in str(jax.make_jaxpr(parallel)(q, k, v))
    expected = values_and_grads(reference, q, k, v)
    return found, expected, uses_shard_map


def temp_bytes(devices: int, seq: int = 16384) -> int:
    """Per-device temporary memory of the compiled causal forward + backward with the sequence
    split over a ring of `devices` (one batch row per device: the data axis takes the rest).
    Small tiles, so that the kernel's tile buffers (a constant) do not hide the O(seq / n)
    terms at this length."""
    mesh = make_mesh(data=8 // devices, sequence=devices)
    shape = jax.ShapeDtypeStruct((8 // devices, seq, 4, 32), jnp.float32)

    def loss(q, k, v):
        return context_parallel_attention(q, k, v, mesh=mesh, spec=Causal(), exchange="ring",
                                          block_sizes=(128, 128)).sum()

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def model_logits() -> tuple[np.ndarray, np.ndarray, bool]:
    """A 2-layer RoPE decoder's logits on one device and under a data=2 x sequence=4 mesh, and
    whether the mesh's forward pass runs its attention context-parallel (a shard_map)."""
    from flax import nnx

    import tfx.models

    model = tfx.models.create("char-gpt", rngs=nnx.Rngs(0), num_layers=2, d_model=32,
                              num_heads=4, attention={"num_kv_heads": 2}, d_ff=64)
    model.eval()
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, SEQ)), jnp.int32)
    single = nnx.jit(lambda m, x: m(x))(model, ids)
    with jax.set_mesh(make_mesh(data=2, sequence=4)):
        split = nnx.jit(lambda m, x: m(x))(model, ids)
        jaxpr = str(jax.make_jaxpr(lambda x: nnx.merge(*nnx.split(model))(x))(ids))
    return np.asarray(single), np.asarray(split), "shard_map" in jaxpr and "ppermute" in jaxpr


if __name__ == "__main__":
    out, arrays, report = sys.argv[1], {}, {"shard_map": {}, "temp_bytes": {}}
    arrays["model:expected"], arrays["model:found"], report["model_shard_map"] = model_logits()
    for name, case in CASES.items():
        found, expected, uses_shard_map = run_case(*case)
        report["shard_map"][name] = uses_shard_map
        for side, (value, grads) in (("found", found), ("expected", expected)):
            for part, x in zip(("out", "dq", "dk", "dv"), (value, *grads), strict=True):
                arrays[f"{name}:{side}:{part}"] = np.asarray(x, np.float32)
        print(name, flush=True)
    for devices in (2, 4, 8):
        report["temp_bytes"][devices] = temp_bytes(devices)
    np.savez(out + ".npz", **arrays)
    with open(out + ".json", "w") as f:
        json.dump(report, f)
