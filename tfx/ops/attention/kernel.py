"""The attention kernel record: a name, what the kernel needs, and how it runs.

Each kernel's module defines its `Kernel`; `tfx.ops.attention.table.KERNELS` names them in the
order `implementation=None` tries them, and `tfx.ops.attention.dispatch` both selects and runs
from that one table. A need is a function `(platform, case) -> None | str`: None when it holds,
else what is missing, phrased to follow "needs" (the error of a forced `implementation=`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tfx.ops.sparse import SparsitySpec

__all__ = ["AttentionCase", "Call", "Kernel", "Need", "at_least", "dtype_in", "key_mask_only", "on",
           "scores_at_least", "value_dim_is_head_dim", "without", "x64_disabled"]


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """The static facts of one attention call that decide which kernels can run it.

    `spec` is the trace-time mask (`is_causal` and `sparsity` as one `tfx.ops.sparse` spec, or
    None). `key_mask` says that the boolean mask masks keys only (it broadcasts from
    [batch, 1, 1, kv_len]: padding), which kernels with segment ids can take as segments.
    `cross_segments` says that key segment ids were given apart from the query's, so they may
    differ (the Pallas GPU kernel takes one array for both). `sequence_devices` is the size of
    the "sequence" axis of the mesh the call is traced under (1: none), over which
    "context_parallel" splits the sequence. `has_softcap` says that the scores are soft-capped
    (`softcap` of `tfx.ops.dot_product_attention`, Gemma 2), which the GPU kernels cannot do;
    `has_sinks` that each head's softmax has a learned sink logit (GPT-OSS).
    """

    dtype: np.dtype
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    has_bias: bool = False
    has_mask: bool = False
    key_mask: bool = False
    has_segments: bool = False
    cross_segments: bool = False
    spec: SparsitySpec | None = None
    sequence_devices: int = 1
    has_softcap: bool = False
    has_sinks: bool = False


@dataclasses.dataclass(frozen=True)
class Call:
    """One validated attention call, as a kernel's `run` receives it.

    query [batch, q_len, num_heads, head_dim], key/value [batch, kv_len, num_kv_heads, dim];
    `segments`: (query ids, key ids), either None; `spec`: the static mask or None; `scale` and
    `softcap` (None: none) make q·k a score; `mesh`: the abstract mesh traced under;
    `block_sizes`: the caller's tiles or None; `platform`: as `jax.default_backend()` names it;
    `sinks`: float [num_heads] sink logits, or None.
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    segments: tuple[jax.Array | None, jax.Array | None]
    spec: SparsitySpec | None
    scale: float
    softcap: float | None
    mesh: Any
    block_sizes: tuple[int, int] | None
    platform: str
    sinks: jax.Array | None = None

    @property
    def interpret(self) -> bool:
        """CPU runs the Pallas kernels only through the interpreter (slow; for tests)."""
        return self.platform == "cpu"


# Each need returns None when it holds, else what is missing, phrased to follow "needs".
Need = Callable[[str, Any], "str | None"]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One attention kernel.

    Attributes:
      name: what `implementation=` calls it.
      run: `run(call) -> output`: for `dot_product_attention` a `Call`, giving
        [batch, q_len, num_heads, value_dim]; paged kernels take their own arguments.
      needs: what a call must have for the kernel to run it (see the module docstring).
      platforms: where `implementation=None` tries it (None: on every platform, even one
        outside the tables; (): never, only when forced).
      when: an extra condition of `implementation=None` on the case (e.g. a size from which
        the kernel is faster), or None.
    """

    name: str
    run: Callable[..., jax.Array]
    needs: tuple[Need, ...] = ()
    platforms: tuple[str, ...] | None = None
    when: Callable[[Any], bool] | None = None

    def missing(self, platform: str, case) -> list[str]:
        """What this kernel needs that `case` lacks on `platform` (empty when it can run)."""
        needs = (need(platform, case) for need in self.needs)
        return [missing for missing in needs if missing is not None]

    def runs(self, platform: str, case) -> bool:
        """Whether this kernel can run `case` on `platform`: `missing` is empty. Stops at the
        first need that fails, so a kernel's later (costlier) needs are asked only of calls
        that meet its first ones."""
        return all(need(platform, case) is None for need in self.needs)

    def tried_by_default(self, platform: str, case) -> bool:
        """Whether `implementation=None` tries this kernel for `case` on `platform`."""
        if self.platforms is not None and platform not in self.platforms:
            return False
        return self.when is None or self.when(case)


def on(*platforms: str) -> Need:
    """The need to run on one of `platforms`."""
    def need(platform, case):
        if platform not in platforms:
            return f"platform {' or '.join(platforms)} (running on {platform})"
    return need


def dtype_in(*names: str) -> Need:
    """The need for inputs of one of the dtypes `names`."""
    def need(platform, case):
        if np.dtype(case.dtype).name not in names:
            return f"dtype {' or '.join(names)} (got {np.dtype(case.dtype).name})"
    return need


def at_least(field: str, minimum: int, what: str) -> Need:
    """The need for the case's `field` to be >= `minimum`; `what` (the error's words) says what
    gives it."""
    def need(platform, case):
        if getattr(case, field) < minimum:
            return what
    return need


def without(field: str, what: str) -> Need:
    """The need for the case's flag `field` (a `what`) to be unset."""
    def need(platform, case):
        if getattr(case, field):
            return f"no {what} (got one)"
    return need


def scores_at_least(count: int) -> Callable[[Any], bool]:
    """A `when`: the call's score matrix holds at least `count` (query, key) pairs, the size
    from which a kernel measures faster than the one after it in the table."""
    def large(case):
        return case.q_len * case.kv_len >= count
    return large


def key_mask_only(platform, case):
    """A mask, if any, masks keys only (kernels that take it as segment ids)."""
    if case.has_mask and not case.key_mask:
        return ("no mask other than a key (padding) mask [batch, 1, 1, kv_len] (got one over "
                "queries)")


def value_dim_is_head_dim(platform, case):
    """Values as wide as queries and keys."""
    if case.value_dim != case.head_dim:
        return f"value_dim equal to head_dim (got {case.value_dim} and {case.head_dim})"


def x64_disabled(platform, case):
    """jax's Pallas GPU kernels mix their int32 program ids with Python ints, which x64 makes
    int64: they then fail to trace."""
    if jax.config.jax_enable_x64:
        return "jax_enable_x64 off (jax's Pallas GPU kernel fails to trace under it)"
