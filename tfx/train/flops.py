"""Model FLOPs utilisation: the FLOPs a training step needs by the PaLM appendix's count,
divided by a peak: the device's nominal one, as MaxText reports MFU (`nominal_peak_flops`; none
is known for CPUs), or this machine's matmul peak measured by `matmul_peak_flops`."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.models.config import EncoderDecoderConfig, TransformerConfig

__all__ = ["NOMINAL_PEAKS", "matmul_peak_flops", "nominal_peak_flops", "parameter_count",
           "training_flops_per_token"]

# Dense bf16 matmul FLOP/s of one chip from its vendor's datasheet (without sparsity), keyed by
# words of `jax.Device.device_kind`; the first key found in the kind as whole words wins, so the
# variants with a lower peak come before the name they share ("NVIDIA H100 PCIe").
NOMINAL_PEAKS = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100", 989e12),
    ("H200", 989e12), ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12),
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5p", 459e12), ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12),
)


def parameter_count(params: nnx.State, *, exclude_positions: bool = True,
                    config: TransformerConfig | None = None) -> int:
    """Number of parameters; learned position tables (`.../positions/...`) are left out by
    default, as the FLOP count asks (a lookup, not a matmul). Given the model's `config`, the
    count is of the parameters one token uses: each MoE layer's experts count
    moe.experts_per_token / moe.num_experts of their size (a token visits k of the E experts)."""
    share = 1.0 if config is None or config.moe is None else (
        config.moe.experts_per_token / config.moe.num_experts)
    return round(sum(np.prod(leaf.shape) * (share if "experts" in path else 1.0)
                     for path, leaf in nnx.to_flat_state(params)
                     if not (exclude_positions and "positions" in path)))


def training_flops_per_token(config: TransformerConfig, num_params: int, seq_len: int) -> float:
    """6·N + 12·L·H·Q·T: forward and backward of every weight once per token (6N), plus
    attention's score and value products (L layers, H heads, Q head dim, T context)."""
    layers = config.num_layers
    if isinstance(config, EncoderDecoderConfig):
        layers += config.decoder_layers
    head_dim = config.attention.head_dim or config.d_model // config.num_heads
    return 6.0 * num_params + 12.0 * layers * config.num_heads * head_dim * seq_len


def nominal_peak_flops(device_kind: str) -> float | None:
    """The dense bf16 peak FLOP/s of one device of kind `device_kind` (`jax.Device.device_kind`,
    e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite") from NOMINAL_PEAKS; None for a kind it does
    not list (CPUs have no such figure)."""
    return next((peak for key, peak in NOMINAL_PEAKS
                 if re.search(rf"\b{re.escape(key)}\b", device_kind)), None)


def matmul_peak_flops(size: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
    """FLOP/s of a jitted [size, size] @ [size, size] product, best of `repeats` (the
    practical peak of this machine for XLA)."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    product = jax.jit(lambda x, y: x @ y)
    product(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best
