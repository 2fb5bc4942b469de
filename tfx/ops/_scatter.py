"""`set_dropping`: `array.at[index].set(updates, mode="drop")` that XLA keeps a scatter.

XLA rewrites a scatter of a single update into a dynamic-update-slice. XLA:CPU then fuses that
into the array's readers and copies the whole array for each (a decoding step at batch 1: four
copies of every layer's KV cache in `tfx.generate`'s loop, and of every page pool in the paged
engine's step). One more update aimed out of bounds, and dropped, keeps the scatter, which XLA
updates in place. The KV-cache writes (`tfx.ops.kv_cache`, `tfx.ops.paged`) go through here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["set_dropping"]


def set_dropping(array: jax.Array, index: tuple, updates: jax.Array, *,
                 updates_axis: int = 0) -> jax.Array:
    """`array.at[index].set(updates, mode="drop")`, with one out-of-bounds update appended.

    Args:
      array: the array written.
      index: one entry per leading axis of `array`: slices, or int arrays that broadcast
        together; each array gets one more entry along its first axis, `array`'s size on its
        axis (out of bounds, so the update is dropped).
      updates: as `.set` takes them; `updates_axis` is the axis the index arrays' first axis
        maps to, where one more (dropped) update is appended.
    """
    padded = tuple(
        entry if isinstance(entry, slice) else
        jnp.concatenate([entry, jnp.full((1, *jnp.shape(entry)[1:]), size, jnp.int32)])
        for entry, size in zip(index, array.shape, strict=False))
    phantom = jax.lax.slice_in_dim(updates, 0, 1, axis=updates_axis)
    return array.at[padded].set(jnp.concatenate([updates, phantom], axis=updates_axis),
                                mode="drop")
