"""Which kernel runs where: the one place that chooses backends by platform.

Selection is pure Python on static facts (shapes, dtypes, which optional inputs are present, the
static mask spec), so it runs at trace time and is unit-tested by passing the platform name
("cpu", "gpu", "tpu") instead of reading `jax.default_backend()`.

Platforms are named as `jax.default_backend()` names them ("cuda" and "rocm" read as "gpu");
a platform outside the tables (a plugin) gets tfx's portable kernels. `current_platform()` is the
one place the running platform is read (tests replace it to fake another).

Attention: the kernels are records (name, needs, run) in `tfx.ops.attention`; the table
`tfx.ops.attention.table.KERNELS` orders them and `tfx.ops.attention.dispatch` selects and
runs from it. Paged attention's records are `tfx.ops.attention.paged.PAGED_KERNELS`. This module
re-exports their selection functions (`select_attention`, `attention_unavailable`,
`AttentionCase`, `select_paged_attention`, ...) under their old names.

Mixture of experts:

| platform | grouped matmul (`experts_ffn`)   | expert-parallel exchange                |
|----------|----------------------------------|-----------------------------------------|
| gpu      | "ragged": `jax.lax.ragged_dot`   | "ragged": `jax.lax.ragged_all_to_all`   |
| tpu      | "megablox": the Pallas `gmm`     | "ragged": `jax.lax.ragged_all_to_all`   |
| cpu      | "sorted": tfx's blocked matmul   | "fixed": capacity buffers, `all_to_all` |
"""

from __future__ import annotations

import jax

from tfx._lazy import lazy_exports

__all__ = [
    "ALL_GATHER_MAX_BYTES",
    "PLATFORMS",
    "current_platform",
    "default_compute_dtype",
    "platform_name",
    "select_context_exchange",
    "select_expert_all_to_all",
    "select_grouped_matmul",
    "supports_ragged_all_to_all",
]

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}

# Attention selection lives with the kernels' records (tfx.ops.attention); loaded on first use.
__getattr__, __dir__ = lazy_exports(__name__, {
    **{name: f"tfx.ops.attention.dispatch:{name}" for name in (
        "ATTENTION_NEEDS", "ATTENTION_PREFERENCE", "attention_unavailable", "select_attention")},
    "BLOCKED_MIN_SCORES": "tfx.ops.attention.blocked:BLOCKED_MIN_SCORES",
    "AttentionCase": "tfx.ops.attention.kernel:AttentionCase",
    **{name: f"tfx.ops.attention.paged:{name}" for name in (
        "PAGED_IMPLEMENTATIONS", "PagedCase", "paged_unavailable", "select_paged_attention")},
})


def current_platform() -> str:
    """The platform jitted code runs on here."""
    return jax.default_backend()


def platform_name(platform: str) -> str:
    """A platform as the tables name it: lower case, "cuda"/"rocm" -> "gpu"."""
    if not isinstance(platform, str):
        raise TypeError(f"platform must be a platform name such as 'cpu', 'gpu' or 'tpu', got "
                        f"{type(platform).__name__}")
    name = platform.lower()
    return _ALIASES.get(name, name)


# Accelerators multiply bfloat16 at several times their float32 rate; CPUs do not.
_COMPUTE_DTYPE = {"gpu": "bfloat16", "tpu": "bfloat16"}


def default_compute_dtype(platform: str) -> str | None:
    """The compute dtype of a model whose config leaves `dtype` unset: "bfloat16" on GPU and TPU
    (with float32 parameters, softmax statistics and router logits), None elsewhere (compute
    in the parameters' float32)."""
    return _COMPUTE_DTYPE.get(platform_name(platform))


# Context parallelism gathers every key and value at once while they take at most this much
# per sequence: one collective instead of n - 1 ring hops, for short sequences and small K/V.
ALL_GATHER_MAX_BYTES = 2**24


def select_context_exchange(devices: int, kv_bytes: int) -> str:
    """The exchange of `tfx.ops.context_parallel_attention`: "all_gather" for a ring of 2
    devices (one hop either way) or when the whole sequence's keys and values take at most
    ALL_GATHER_MAX_BYTES per batch row (`kv_bytes`), else "ring" (O(T / n) memory)."""
    return "all_gather" if devices <= 2 or kv_bytes <= ALL_GATHER_MAX_BYTES else "ring"


_GROUPED_MATMUL = {"gpu": "ragged", "tpu": "megablox"}
# XLA:CPU has no ragged-all-to-all thunk (it fails at compile time with UNIMPLEMENTED).
_RAGGED_ALL_TO_ALL = ("gpu", "tpu")


def select_grouped_matmul(platform: str) -> str:
    """The `experts_ffn` implementation for `platform`: "ragged" (GPU), "megablox" (TPU) or
    "sorted" (anything else)."""
    return _GROUPED_MATMUL.get(platform_name(platform), "sorted")


def supports_ragged_all_to_all(platform: str) -> bool:
    """Whether XLA implements `jax.lax.ragged_all_to_all` on `platform`."""
    return platform_name(platform) in _RAGGED_ALL_TO_ALL


def select_expert_all_to_all(platform: str) -> str:
    """The exchange of `expert_parallel_moe` for `platform`: "ragged" (exactly the routed rows,
    where `ragged_all_to_all` exists) or "fixed" (capacity-sized buffers, `all_to_all`)."""
    return "ragged" if supports_ragged_all_to_all(platform) else "fixed"
