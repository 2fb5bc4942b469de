"""How context parallelism cuts a sequence: the chunks each device holds (`ChunkLayout`, the
zigzag of causal load balance) and the tile plan of every (query chunk, key chunk) pair
(`pair_plans`), all static, decided at trace time. `tfx.ops.attention.context_parallel` runs the
exchange over them."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops.attention.block_plan import BlockPlan, block_plan
from tfx.ops.sparse import Offset, SparsitySpec

__all__ = ["MAX_PAIR_PLANS", "ChunkLayout", "pair_plans"]

# Distinct tile plans a mask may need over all chunk pairs: each is compiled as one branch.
MAX_PAIR_PLANS = 16


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """How a device's slice is cut: `chunks_per_device` chunks of `chunk_len` tokens; device d
    holds chunks (d, 2n - 1 - d) when `zigzag`, else chunk d."""

    devices: int
    chunks_per_device: int
    chunk_len: int

    @classmethod
    def of(cls, devices: int, seq: int, *, zigzag: bool) -> ChunkLayout:
        per_device = 2 if zigzag and devices > 1 else 1
        chunks = devices * per_device
        if seq % chunks:
            why = " (2 per device: causal load balance)" if per_device == 2 else ""
            raise ValueError(f"sequence length {seq} must be divisible by {chunks} chunks over "
                             f"{devices} devices{why}")
        return cls(devices, per_device, seq // chunks)

    @property
    def zigzag(self) -> bool:
        return self.chunks_per_device == 2

    @property
    def num_chunks(self) -> int:
        return self.devices * self.chunks_per_device

    def chunk_ids(self, device: jax.Array) -> list[jax.Array]:
        """The global indices of the chunks `device` holds, in its local order."""
        return [device, 2 * self.devices - 1 - device] if self.zigzag else [device]

    def chunked(self, query, key, value, ring):
        """Local [B, c·C, H, D] slices -> query [c, B, K, G, Cq, D], key and value
        [c, B, K, Ck, D], each chunk padded to whole tiles (Cq, Ck: the ring's padded_q and
        padded_k)."""
        batch, _, heads, head_dim = query.shape
        kv_heads = key.shape[2]
        c, size = self.chunks_per_device, self.chunk_len
        q = query.reshape(batch, c, size, kv_heads, heads // kv_heads, head_dim)
        q = _pad(q.transpose(1, 0, 3, 4, 2, 5), 4, ring.padded_q)
        k, v = (_pad(x.reshape(batch, c, size, kv_heads, x.shape[3]).transpose(1, 0, 3, 2, 4),
                     3, ring.padded_k) for x in (key, value))
        return q, k, v

    def chunked_ids(self, ids: jax.Array, padded: int) -> jax.Array:
        """int [B, c·C] -> int32 [c, B, padded]."""
        ids = ids.astype(jnp.int32).reshape(ids.shape[0], self.chunks_per_device, -1)
        return _pad(ids.transpose(1, 0, 2), 2, padded)

    def unchunked(self, out: jax.Array, heads: int) -> jax.Array:
        """[c, B, K, G, Cq, Dv] -> [B, c·C, H, Dv] (padding dropped)."""
        out = out[:, :, :, :, : self.chunk_len]
        c, batch, _, _, size, dim = out.shape
        return out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, c * size, heads, dim)


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads)


@functools.lru_cache(maxsize=64)
def pair_plans(spec: SparsitySpec | None, num_chunks: int, chunk_len: int, block_q: int,
               block_k: int) -> tuple[tuple[BlockPlan, ...], np.ndarray]:
    """The tile plans of every (query chunk, key chunk) pair of a sequence cut in `num_chunks`
    chunks of `chunk_len`, computed at trace time.

    Returns:
      (plans, table): the distinct non-empty plans, and int32 [num_chunks, num_chunks] whose
      entry [a, b] is 0 when query chunk a sees nothing of key chunk b, else 1 + the index of
      its plan.
    Raises:
      ValueError: more than MAX_PAIR_PLANS distinct plans (a pattern tied to absolute
        positions, such as random blocks, over many chunks).
    """
    total = num_chunks * chunk_len
    plans, index = [], {}
    table = np.zeros((num_chunks, num_chunks), np.int32)
    for a in range(num_chunks):
        for b in range(num_chunks):
            pair = None if spec is None else Offset(spec, a * chunk_len, b * chunk_len, total)
            plan = block_plan(pair, chunk_len, chunk_len, block_q, block_k)
            if plan.num_tiles == 0:
                continue
            signature = tuple(np.asarray(field).tobytes() for field in (
                plan.key_blocks, plan.visits, plan.full_visits, plan.tile_mask_ids,
                plan.tile_masks))
            if signature not in index:
                index[signature] = len(plans)
                plans.append(plan)
            table[a, b] = 1 + index[signature]
    if len(plans) > MAX_PAIR_PLANS:
        raise ValueError(f"sparsity {spec} needs {len(plans)} distinct tile plans over "
                         f"{num_chunks} sequence chunks (at most {MAX_PAIR_PLANS}): context "
                         "parallelism takes masks that depend on distances (causal, windows, "
                         "strides) or few chunks")
    return tuple(plans), table
