"""Checksums of a checkpointed state: one 64-bit value per leaf, whatever the leaf's sharding.

A leaf's bits are read as uint32 words ``w[i]`` (flat C-order position ``i``; 8- and 16-bit
elements are zero-extended, 64-bit ones give two words, low word first) and its checksum is
two 32-bit lanes::

    lane_k = sum_i fmix32(w[i] ^ fmix32(i ^ SEED_k))   mod 2**32

with ``fmix32`` MurmurHash3's finaliser, a bijection of uint32. Why this form:
- a sum does not depend on the order of its terms, so each device sums its own shard and XLA
  adds the partial sums: one fused pass on device, no copy to the host, and a checkpoint
  written by 8 devices in 2 processes verifies when it is read back by one;
- changing any one word (a flipped bit) changes both lanes, because ``w -> fmix32(w ^ c)`` is
  a bijection; random damage to more words goes unnoticed with probability about 2**-64;
- the position enters every term, so words swapped between positions are caught too.
It guards against damaged files, not against someone forging them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

ALGORITHM = "fmix32-sum-2x32"  # stored with the checksums; another name is never compared
_SEEDS = (0x9E3779B9, 0x7F4A7C15)


def checksums(tree: Any) -> dict[str, str]:
    """Checksum of every leaf of `tree`, keyed by orbax's flat path ("params/w/value").

    Args:
      tree: pytree of jax arrays (any sharding, typed PRNG keys as their key data), numpy
        arrays and python scalars. With several processes every process must call this
        together (jax arrays are reduced by one jitted program over their devices).
    Returns:
      {path: 16 hex digits}; equal for equal values, whatever the sharding or process count.
    """
    flat = ocp.tree.to_flat_dict(tree, sep="/")
    groups: dict[frozenset, list[str]] = {}  # one jitted call per set of devices
    sums = {}
    for path, leaf in flat.items():
        if isinstance(leaf, jax.Array):
            groups.setdefault(frozenset(leaf.sharding.device_set), []).append(path)
        else:
            sums[path] = _lanes(_host_words(leaf), np)
    for paths in groups.values():
        lanes = _device_lanes([flat[p] for p in paths])  # replicated scalars: any copy will do
        lanes = jax.device_get(jax.tree.map(lambda x: x.addressable_data(0), lanes))
        sums.update(zip(paths, lanes, strict=True))
    return {path: "".join(f"{int(lane):08x}" for lane in sums[path]) for path in flat}


def mismatches(tree: Any, recorded: dict) -> list[str]:
    """Flat paths of the leaves of `tree` whose checksum is not the one in `recorded` (the
    JSON written by `record`), sorted; one entry naming the algorithm when `recorded` was
    made by another one (its values cannot be compared)."""
    if recorded.get("algorithm") != ALGORITHM:
        return [f"<checksums of unknown algorithm {recorded.get('algorithm')!r}>"]
    want = recorded.get("leaves", {})
    return sorted(path for path, value in checksums(tree).items() if want.get(path) != value)


def record(tree: Any) -> dict:
    """The JSON-able record of `tree`'s checksums that is saved beside it."""
    return {"algorithm": ALGORITHM, "leaves": checksums(tree)}


@jax.jit
def _device_lanes(leaves: list[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
    return [_lanes(_device_words(x), jnp) for x in leaves]


def _device_words(x: jax.Array) -> jax.Array:
    """uint32 words of a (traced) jax array's bits: x.shape, plus a trailing 2 for 64 bits."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):  # bitcasts take no complex numbers
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = x.dtype.itemsize * 8
    x = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}"))
    return x.astype(jnp.uint32) if bits < 32 else jax.lax.bitcast_convert_type(x, jnp.uint32)


def _host_words(x: Any) -> np.ndarray:
    """uint32 words of a numpy array's or python scalar's bits, flat, in `_device_words`'
    order (so a leaf saved from device and restored into numpy has the same checksum)."""
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype.itemsize < 4:
        return x.view(f"u{x.dtype.itemsize}").astype(np.uint32)
    return x.view(np.uint32)


def _lanes(words, xp) -> tuple:
    """The two checksum lanes (uint32 scalars) of a uint32 array; xp: numpy or jax.numpy."""
    index = _flat_index(words.shape, xp)
    return tuple(xp.sum(_fmix32(words ^ _fmix32(index ^ xp.uint32(seed), xp), xp),
                        dtype=xp.uint32) for seed in _SEEDS)


def _flat_index(shape: tuple[int, ...], xp):
    """uint32 array of `shape` holding each element's C-order flat position mod 2**32."""
    index = xp.zeros(shape, xp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        along = xp.arange(shape[axis], dtype=xp.uint32).reshape((-1,) + (1,) * (len(shape)
                                                                               - axis - 1))
        index = index + along * xp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _fmix32(h, xp):
    """MurmurHash3's 32-bit finaliser (a bijection of uint32), elementwise; wraps mod 2**32."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)
