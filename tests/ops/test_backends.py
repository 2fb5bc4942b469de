"""The attention selection table, with the platform faked by passing its name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops import backends, dot_product_attention, sparse
from tfx.ops.backends import AttentionCase, attention_unavailable, select_attention

# A training-shaped self-attention call that every kernel can run on its own platform.
BF16 = AttentionCase(dtype=jnp.bfloat16, q_len=1024, kv_len=1024, num_heads=8, num_kv_heads=2,
                     head_dim=128, value_dim=128, spec=sparse.Causal())
F32 = dataclasses.replace(BF16, dtype=jnp.float32)


PLATFORMS = backends.PLATFORMS


def case(base=BF16, **changes):
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(("platform", "attention", "expected"), [
    # CPU: tfx's kernels, by score-matrix size (the rule from before platforms existed).
    ("cpu", BF16, "blocked"),
    ("cpu", case(q_len=512, kv_len=512), "reference"),
    ("cpu", case(q_len=512, kv_len=1024), "blocked"),  # 2**19 scores: the threshold itself
    # GPU: cuDNN for half precision with a causal / window / no static mask...
    ("gpu", BF16, "cudnn"),
    ("gpu", case(dtype=jnp.float16, spec=None, q_len=256, kv_len=384), "cudnn"),
    ("gpu", case(spec=sparse.SlidingWindow(64)), "cudnn"),
    ("gpu", case(spec=sparse.Causal() & sparse.SlidingWindow(64)), "cudnn"),
    ("gpu", case(has_bias=True), "cudnn"),
    # ... else Pallas flash for causal / no mask, self-attention lengths, no bias or mask ...
    ("gpu", F32, "pallas_gpu"),
    ("gpu", case(head_dim=256, value_dim=256), "pallas_gpu"),
    ("gpu", case(has_segments=True), "pallas_gpu"),
    ("gpu", case(q_len=512, kv_len=1024), "blocked"),  # causal needs equal lengths
    # ... else tfx's kernels.
    ("gpu", case(F32, spec=sparse.Strided(64)), "blocked"),
    ("gpu", case(F32, has_bias=True), "blocked"),
    ("gpu", case(has_mask=True), "blocked"),
    ("gpu", case(has_segments=True, cross_segments=True), "blocked"),
    ("gpu", case(F32, q_len=1000, kv_len=1000), "blocked"),
    ("gpu", case(F32, q_len=128, kv_len=128), "pallas_gpu"),
    ("gpu", case(F32, q_len=64, kv_len=64), "reference"),
    # TPU: splash for every spec and segment ids, without bias or mask, 128-multiple lengths.
    ("tpu", BF16, "splash"),
    ("tpu", case(F32, spec=sparse.Strided(64) | sparse.GlobalTokens(4)), "splash"),
    ("tpu", case(has_segments=True, cross_segments=True, q_len=256), "splash"),
    ("tpu", case(has_bias=True), "blocked"),
    ("tpu", case(has_mask=True), "blocked"),
    ("tpu", case(has_mask=True, key_mask=True), "splash"),  # padding, as segment ids
    ("gpu", case(has_mask=True, key_mask=True), "blocked"),
    ("tpu", case(q_len=1000), "blocked"),
    # Under a mesh whose "sequence" axis splits the sequence: context parallelism first, on
    # every platform, for self-attention without a bias whose length cuts into 2n chunks.
    *((platform, case(sequence_devices=4), "context_parallel") for platform in PLATFORMS),
    ("cpu", case(sequence_devices=4, has_mask=True, key_mask=True), "context_parallel"),
    ("cpu", case(sequence_devices=4, spec=None, q_len=1028, kv_len=1028), "context_parallel"),
    ("cpu", case(sequence_devices=4, q_len=1028, kv_len=1028), "blocked"),  # not 8 chunks
    ("cpu", case(sequence_devices=4, has_bias=True), "blocked"),
    ("cpu", case(sequence_devices=4, kv_len=2048), "blocked"),  # cross-attention lengths
    ("gpu", case(sequence_devices=1), "cudnn"),
])
def test_selection_table(platform, attention, expected):
    assert select_attention(platform, attention) == expected


def test_every_platform_list_names_known_kernels_only():
    assert set(backends.ATTENTION_PREFERENCE) == set(backends.PLATFORMS)
    for kernels in backends.ATTENTION_PREFERENCE.values():
        assert set(kernels) <= set(backends.ATTENTION_NEEDS) - {"reference", "blocked"}


@pytest.mark.parametrize(("implementation", "platform", "attention", "missing"), [
    ("cudnn", "cpu", BF16, "platform gpu (running on cpu)"),
    ("cudnn", "gpu", F32, "dtype float16 or bfloat16 (got float32)"),
    ("cudnn", "gpu", case(head_dim=256, value_dim=256), "head_dim <= 128"),
    ("cudnn", "gpu", case(value_dim=64), "value_dim equal to head_dim"),
    ("cudnn", "gpu", case(has_mask=True), "no mask"),
    ("cudnn", "gpu", case(spec=sparse.Fixed(64, 8)), "causal or sliding-window"),
    ("cudnn", "gpu", case(q_len=512), "q_len == kv_len with a static mask"),
    ("cudnn", "gpu", case(has_bias=True, spec=None, q_len=513), "even q_len and kv_len"),
    ("pallas_gpu", "tpu", F32, "platform gpu or cpu (running on tpu)"),
    ("pallas_gpu", "gpu", case(has_bias=True), "no bias"),
    ("pallas_gpu", "gpu", case(spec=sparse.SlidingWindow(8)), "is_causal or no static mask"),
    ("pallas_gpu", "gpu", case(has_segments=True, cross_segments=True), "key_segment_ids"),
    ("pallas_gpu", "gpu", case(head_dim=8, value_dim=8), "head_dim in [16, 256]"),
    ("splash", "gpu", F32, "platform tpu or cpu (running on gpu)"),
    ("splash", "tpu", case(has_bias=True), "no bias"),
    ("splash", "tpu", case(kv_len=1000), "multiples of 128 (got 1024 and 1000)"),
    ("splash", "tpu", case(dtype=jnp.float64), "dtype float16 or bfloat16 or float32"),
    ("context_parallel", "cpu", BF16, 'a mesh with a "sequence" axis of size >= 2'),
    ("context_parallel", "cpu", case(sequence_devices=2, has_bias=True), "no bias"),
    ("context_parallel", "cpu", case(sequence_devices=2, has_mask=True), "no mask other than"),
    ("context_parallel", "cpu", case(sequence_devices=3), "divisible by 6 chunks"),
])
def test_unavailable_names_what_is_missing(implementation, platform, attention, missing):
    reasons = attention_unavailable(implementation, platform, attention)
    assert any(missing in reason for reason in reasons), reasons


def test_available_kernels_report_nothing_missing():
    assert attention_unavailable("cudnn", "gpu", BF16) == []
    assert attention_unavailable("pallas_gpu", "cpu", F32) == []
    assert attention_unavailable("splash", "cpu", F32) == []
    for platform in backends.PLATFORMS:
        assert attention_unavailable("blocked", platform, BF16) == []


def test_platforms_outside_the_table_get_the_portable_kernels():
    assert select_attention("metal", BF16) == select_attention("cpu", BF16)
    assert select_attention("CUDA", BF16) == select_attention("gpu", BF16) == "cudnn"
    with pytest.raises(TypeError, match="platform must be a platform name"):
        select_attention(None, BF16)


def _qkv(q_len=128, kv_len=128, heads=(4, 2), head_dim=64, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    query = jax.random.normal(keys[0], (1, q_len, heads[0], head_dim), dtype)
    key, value = (jax.random.normal(k, (1, kv_len, heads[1], head_dim), dtype) for k in keys[1:])
    return query, key, value


@pytest.mark.parametrize(("implementation", "kwargs", "message"), [
    ("cudnn", {}, r"implementation='cudnn' cannot run this call; it needs platform gpu"),
    ("splash", {"bias": jnp.zeros((1, 1, 128, 128))}, r"'splash' cannot run.*needs no bias"),
    ("pallas_gpu", {"mask": jnp.ones((128, 128), bool)}, r"'pallas_gpu' cannot run.*no mask"),
    ("splash", {"kv_len": 100}, r"'splash' cannot run.*multiples of 128 \(got 128 and 100\)"),
    ("context_parallel", {}, r"'context_parallel' cannot run.*a mesh with a \"sequence\" axis"),
])
def test_forcing_an_unavailable_kernel_raises_before_running(implementation, kwargs, message):
    query, key, value = _qkv(kv_len=kwargs.pop("kv_len", 128))
    with pytest.raises(ValueError, match=message):
        dot_product_attention(query, key, value, implementation=implementation, **kwargs)


def test_unknown_implementation_lists_the_known_ones():
    query, key, value = _qkv()
    with pytest.raises(ValueError, match=r"'splash'.*got 'flash'"):
        dot_product_attention(query, key, value, implementation="flash")


def test_cpu_default_matches_the_reference_bit_for_bit():
    """On CPU implementation=None keeps its old meaning: the reference below 2**19 scores."""
    query, key, value = _qkv()
    np.testing.assert_array_equal(
        dot_product_attention(query, key, value, is_causal=True),
        dot_product_attention(query, key, value, is_causal=True, implementation="reference"))
