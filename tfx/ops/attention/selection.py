"""Which attention kernel runs a call: the records of `tfx.ops.attention.table`, in its order.

Selection is pure Python on static facts (shapes, dtypes, which optional inputs are present, the
static mask spec), so it runs at trace time and is unit-tested by passing the platform name
("cpu", "gpu", "tpu") instead of reading `jax.default_backend()`. The same records run the
kernel selected (`kernel(name).run(call)`), so the table that selects a kernel runs it.
"""

from __future__ import annotations

import importlib

from tfx.ops.attention import table
from tfx.ops.attention.blocked import BLOCKED_MIN_SCORES
from tfx.ops.attention.kernel import AttentionCase, Kernel, Need
from tfx.ops.backends import PLATFORMS, platform_name

__all__ = ["ATTENTION_NEEDS", "ATTENTION_PREFERENCE", "BLOCKED_MIN_SCORES", "KERNELS",
           "attention_unavailable", "kernel", "select_attention"]


def _load(name: str, reference: str) -> Kernel:
    module, _, attribute = reference.partition(":")
    record = getattr(importlib.import_module(module), attribute)
    if record.name != name:
        raise ValueError(f"the table's kernel {name!r} points at the record of {record.name!r}")
    return record


# name -> record, in the order implementation=None tries them.
KERNELS: dict[str, Kernel] = {name: _load(name, ref) for name, ref in table.KERNELS.items()}
# Views of the records: what each kernel needs, and the platform-specific kernels per platform.
ATTENTION_NEEDS: dict[str, tuple[Need, ...]] = {k.name: k.needs for k in KERNELS.values()}
ATTENTION_PREFERENCE: dict[str, tuple[str, ...]] = {
    platform: tuple(k.name for k in KERNELS.values() if k.platforms and platform in k.platforms)
    for platform in PLATFORMS
}


def kernel(name: str) -> Kernel:
    """The record of kernel `name` (one of `tfx.ops.attention.IMPLEMENTATIONS`)."""
    return KERNELS[name]


def attention_unavailable(implementation: str, platform: str, case: AttentionCase) -> list[str]:
    """What `implementation` needs that this call lacks on `platform` (empty when it can run)."""
    return KERNELS[implementation].missing(platform_name(platform), case)


def select_attention(platform: str, case: AttentionCase) -> str:
    """The fastest attention kernel that can run `case` on `platform`.

    Args:
      platform: "cpu", "gpu" or "tpu", as `jax.default_backend()` names them (others get tfx's
        portable kernels).
      case: the static facts of the call.
    Returns:
      the first name of `tfx.ops.attention.table.KERNELS` tried on the platform whose needs
      hold: "context_parallel", "cudnn", "pallas_gpu", "splash", "blocked" or "reference".
    """
    platform = platform_name(platform)
    for record in KERNELS.values():
        if record.tried_by_default(platform, case) and not record.missing(platform, case):
            return record.name
    raise AssertionError("the reference kernel runs every call")  # it ends the table
