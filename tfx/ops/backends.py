"""Which kernel runs where: the one place that chooses backends by platform.

Selection is pure Python on static facts (shapes, dtypes, which optional inputs are present, the
static mask spec), so it runs at trace time and is unit-tested by passing the platform name
("cpu", "gpu", "tpu") instead of reading `jax.default_backend()`.

Platforms are named as `jax.default_backend()` names them ("cuda" and "rocm" read as "gpu");
a platform outside the tables (a plugin) gets tfx's portable kernels. `current_platform()` is the
one place the running platform is read (tests replace it to fake another).

Attention: `ATTENTION_PREFERENCE` lists, per platform, the kernels to try in order, and
`ATTENTION_NEEDS` lists what each kernel needs; the first whose needs all hold runs. tfx's own
kernels ("reference", "blocked") run everywhere, so every list ends with them. The same needs
explain why a forced `implementation=` cannot run. Logit soft-capping (`softcap`) runs on every
kernel but "cudnn" and "pallas_gpu", so a GPU call with it gets tfx's kernels.

Mixture of experts:

| platform | grouped matmul (`experts_ffn`)   | expert-parallel exchange                |
|----------|----------------------------------|-----------------------------------------|
| gpu      | "ragged": `jax.lax.ragged_dot`   | "ragged": `jax.lax.ragged_all_to_all`   |
| tpu      | "megablox": the Pallas `gmm`     | "ragged": `jax.lax.ragged_all_to_all`   |
| cpu      | "sorted": tfx's blocked matmul   | "fixed": capacity buffers, `all_to_all` |

Paged attention (`tfx.ops.paged_attention`): `PAGED_PREFERENCE` per platform, `PAGED_NEEDS` per
kernel, as for attention: jax's Pallas paged kernels on GPU and TPU for decoding steps (one query
per sequence), else tfx's "blocked" (page loop, online softmax) or "reference" (gather pages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from tfx.ops.gpu_attention import cudnn_mask
from tfx.ops.sparse import Causal, SparsitySpec

__all__ = [
    "ALL_GATHER_MAX_BYTES",
    "ATTENTION_FIRST",
    "ATTENTION_NEEDS",
    "ATTENTION_PREFERENCE",
    "BLOCKED_MIN_SCORES",
    "PAGED_IMPLEMENTATIONS",
    "PAGED_NEEDS",
    "PAGED_PREFERENCE",
    "PLATFORMS",
    "AttentionCase",
    "PagedCase",
    "attention_unavailable",
    "current_platform",
    "default_compute_dtype",
    "paged_unavailable",
    "platform_name",
    "select_attention",
    "select_context_exchange",
    "select_expert_all_to_all",
    "select_grouped_matmul",
    "select_paged_attention",
    "supports_ragged_all_to_all",
]

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
# The score-matrix size from which tfx's blocked kernel beats the reference path (measured on
# CPU with benchmarks/attention.py: between 512² (reference faster) and 1024² (blocked ~2x)).
BLOCKED_MIN_SCORES = 2**19
# cuDNN's flash attention takes head_dim <= 128 before Hopper and <= 256 from Hopper on; the
# platform name does not say which GPU this is, so selection keeps the limit every GPU meets.
CUDNN_MAX_HEAD_DIM = 128
# Lengths that the Pallas kernels tile without padding (padding keys would need a key mask,
# which the GPU kernel cannot take): splash's kv blocks are multiples of 128 lanes, and the
# GPU kernel's 128-row forward and 32-row backward blocks then divide the sequence.
PALLAS_LENGTH_MULTIPLE = 128


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
    (`softcap` of `tfx.ops.dot_product_attention`, Gemma 2), which the GPU kernels cannot do.
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


# Each need returns None when it holds, else what is missing, phrased to follow "needs".
Need = Callable[[str, AttentionCase], "str | None"]


def _on(*platforms: str) -> Need:
    def need(platform, case):
        if platform not in platforms:
            return f"platform {' or '.join(platforms)} (running on {platform})"
    return need


def _dtype_in(*names: str) -> Need:
    def need(platform, case):
        if np.dtype(case.dtype).name not in names:
            return f"dtype {' or '.join(names)} (got {np.dtype(case.dtype).name})"
    return need


def _without(field: str, what: str) -> Need:
    def need(platform, case):
        if getattr(case, field):
            return f"no {what} (got one)"
    return need


def _key_mask_only(platform, case):
    if case.has_mask and not case.key_mask:
        return ("no mask other than a key (padding) mask [batch, 1, 1, kv_len] (got one over "
                "queries)")


def _cudnn_head_dim(platform, case):
    if case.head_dim > CUDNN_MAX_HEAD_DIM or case.head_dim % 8:
        return f"head_dim <= {CUDNN_MAX_HEAD_DIM} and a multiple of 8 (got {case.head_dim})"


def _pallas_gpu_head_dim(platform, case):
    # Triton's dot needs at least 16 on each side; 256 bounds the shared memory of one tile.
    if not 16 <= case.head_dim <= 256 or case.head_dim % 16:
        return f"head_dim in [16, 256] and a multiple of 16 (got {case.head_dim})"


def _value_dim_is_head_dim(platform, case):
    if case.value_dim != case.head_dim:
        return f"value_dim equal to head_dim (got {case.value_dim} and {case.head_dim})"


def _cudnn_spec(platform, case):
    if cudnn_mask(case.spec) is None:
        return f"a causal or sliding-window static mask, or none (got {case.spec})"
    if case.spec is not None and case.q_len != case.kv_len:
        # cuDNN aligns its causal mask bottom-right when q_len != kv_len, tfx top-left.
        return f"q_len == kv_len with a static mask (got {case.q_len} and {case.kv_len})"


def _cudnn_bias_lengths(platform, case):
    if case.has_bias and (case.q_len % 2 or case.kv_len % 2):
        return f"even q_len and kv_len with a bias (got {case.q_len} and {case.kv_len})"


def _causal_or_none(platform, case):
    if case.spec is not None and case.spec != Causal():
        return f"is_causal or no static mask, no other sparsity (got {case.spec})"


def _self_attention_lengths(platform, case):
    # The fused backward pass cuts queries and keys into the same number of blocks.
    if case.q_len != case.kv_len or case.q_len % PALLAS_LENGTH_MULTIPLE:
        return (f"q_len == kv_len, a multiple of {PALLAS_LENGTH_MULTIPLE} "
                f"(got {case.q_len} and {case.kv_len})")


def _x64_disabled(platform, case):
    # jax's Pallas GPU kernel mixes its int32 program ids with Python ints, which x64 makes
    # int64: its causal forward and its backward then fail to trace.
    if jax.config.jax_enable_x64:
        return "jax_enable_x64 off (jax's Pallas GPU kernel fails to trace under it)"


def _splash_lengths(platform, case):
    if case.q_len % PALLAS_LENGTH_MULTIPLE or case.kv_len % PALLAS_LENGTH_MULTIPLE:
        return (f"q_len and kv_len multiples of {PALLAS_LENGTH_MULTIPLE} "
                f"(got {case.q_len} and {case.kv_len})")


def _sequence_split(platform, case):
    if case.sequence_devices < 2:
        return "a mesh with a \"sequence\" axis of size >= 2 (inside jax.set_mesh)"


def _context_lengths(platform, case):
    # Self-attention whose length cuts into 2 chunks per device (causal load balance).
    chunks = case.sequence_devices * (1 if case.spec is None else 2)
    if case.q_len != case.kv_len or case.q_len % chunks:
        return (f"q_len == kv_len, divisible by {chunks} chunks "
                f"(got {case.q_len} and {case.kv_len})")


# jax exposes no logit soft-capping for cuDNN's fused attention nor for the Pallas GPU kernel;
# tfx's kernels, splash (`attn_logits_soft_cap`) and context parallelism (tfx's tiles) cap.
# On "cpu" the Pallas kernels run in interpret mode: slow, but the same code path, for tests.
ATTENTION_NEEDS: dict[str, tuple[Need, ...]] = {
    "reference": (),
    "blocked": (),
    "cudnn": (_on("gpu"), _dtype_in("float16", "bfloat16"), _cudnn_head_dim,
              _value_dim_is_head_dim, _without("has_mask", "mask"),
              _without("has_segments", "segment ids"), _cudnn_spec, _cudnn_bias_lengths,
              _without("has_softcap", "softcap")),
    "pallas_gpu": (_on("gpu", "cpu"), _dtype_in("float16", "bfloat16", "float32"),
                   _pallas_gpu_head_dim, _value_dim_is_head_dim, _without("has_bias", "bias"),
                   _without("has_mask", "mask"),
                   _without("cross_segments", "key_segment_ids apart from query_segment_ids"),
                   _causal_or_none, _self_attention_lengths, _x64_disabled,
                   _without("has_softcap", "softcap")),
    "splash": (_on("tpu", "cpu"), _dtype_in("float16", "bfloat16", "float32"),
               _without("has_bias", "bias"), _key_mask_only, _splash_lengths),
    "context_parallel": (_sequence_split, _without("has_bias", "bias"), _key_mask_only,
                         _context_lengths),
}
# Tried before the platform's kernels: under a mesh that splits the sequence, attention that
# can run context-parallel does (tfx.ops.context_parallel); its tiles use the blocked kernel.
ATTENTION_FIRST = ("context_parallel",)

# Kernels tried in order; tfx's own kernels (see `_portable`) end every list.
ATTENTION_PREFERENCE: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "gpu": ("cudnn", "pallas_gpu"),
    "tpu": ("splash",),
}


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


def attention_unavailable(implementation: str, platform: str, case: AttentionCase) -> list[str]:
    """What `implementation` needs that this call lacks on `platform` (empty when it can run)."""
    platform = platform_name(platform)
    needs = (need(platform, case) for need in ATTENTION_NEEDS[implementation])
    return [missing for missing in needs if missing is not None]


def select_attention(platform: str, case: AttentionCase) -> str:
    """The fastest attention kernel that can run `case` on `platform`.

    Args:
      platform: "cpu", "gpu" or "tpu", as `jax.default_backend()` names them (others get tfx's
        portable kernels).
      case: the static facts of the call.
    Returns:
      one of "context_parallel", "cudnn", "pallas_gpu", "splash", "blocked", "reference".
    """
    for implementation in (*ATTENTION_FIRST, *ATTENTION_PREFERENCE.get(platform_name(platform),
                                                                         ())):
        if not attention_unavailable(implementation, platform, case):
            return implementation
    return _portable(case)


def _portable(case: AttentionCase) -> str:
    """tfx's own kernels: small problems are faster in one fused piece."""
    return "blocked" if case.q_len * case.kv_len >= BLOCKED_MIN_SCORES else "reference"


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


PAGED_IMPLEMENTATIONS = ("reference", "blocked", "pallas_gpu", "pallas_tpu")


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """The static facts of one paged-attention call: query length, the page table's width,
    page size, head and value dims and the dtype."""

    q_len: int
    pages_per_seq: int
    page_size: int
    head_dim: int
    value_dim: int
    dtype: np.dtype


def _one_query(platform, case):
    if case.q_len != 1:
        return f"one query per sequence (a decoding step; got q_len {case.q_len})"


def _paged_gpu_shapes(platform, case):
    # Triton's dot needs 16 on each side; the kernel reads keys and values with one layout.
    if case.head_dim % 16 or case.value_dim != case.head_dim or case.page_size % 16:
        return (f"head_dim a multiple of 16, value_dim == head_dim and page_size a multiple of "
                f"16 (got {case.head_dim}, {case.value_dim}, {case.page_size})")


def _paged_tpu_shapes(platform, case):
    # The TPU kernel tiles a page's tokens over the 128 lanes of a vector register.
    if case.value_dim != case.head_dim or case.page_size % 128:
        return (f"value_dim == head_dim and page_size a multiple of 128 (got {case.value_dim}, "
                f"{case.head_dim}, {case.page_size})")


PAGED_NEEDS: dict[str, tuple[Need, ...]] = {
    "reference": (),
    "blocked": (),
    "pallas_gpu": (_on("gpu", "cpu"), _dtype_in("float16", "bfloat16", "float32"), _one_query,
                   _paged_gpu_shapes, _x64_disabled),
    "pallas_tpu": (_on("tpu"), _dtype_in("float32", "bfloat16"), _one_query,
                   _paged_tpu_shapes),
}
PAGED_PREFERENCE: dict[str, tuple[str, ...]] = {"gpu": ("pallas_gpu",), "tpu": ("pallas_tpu",)}


def paged_unavailable(implementation: str, platform: str, case: PagedCase) -> list[str]:
    """What paged `implementation` needs that this call lacks on `platform` (empty: runs)."""
    platform = platform_name(platform)
    needs = (need(platform, case) for need in PAGED_NEEDS[implementation])
    return [missing for missing in needs if missing is not None]


def select_paged_attention(platform: str, case: PagedCase) -> str:
    """The paged-attention kernel for `case` on `platform`: the platform's Pallas kernel when it
    can run (decoding steps), else "blocked". The blocked loop reads only the pages up to the
    furthest query, where "reference" gathers the whole page table's width: measured on CPU
    (char-gpt shape, batch 8, 1024-token table, ~300 tokens live) a decoding step took 7.1 ms
    against 16.9 ms."""
    for implementation in PAGED_PREFERENCE.get(platform_name(platform), ()):
        if not paged_unavailable(implementation, platform, case):
            return implementation
    return "blocked"
