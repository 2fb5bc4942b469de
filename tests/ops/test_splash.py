"""TPU splash attention in Pallas interpret mode on CPU, against the reference attention.

Forcing implementation="splash" on CPU runs the TPU kernel's own code through the Pallas
interpreter: the values and gradients below are splash's, on shapes small enough for CPU. Each
kernel compiles for ~5-10 s in interpret mode, so the per-spec kernel runs are marked slow; the
fast set checks every spec's splash mask against `spec.dense` without running the kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from kernel_cases import attention_values_and_grads

from tfx.ops import backends, dot_product_attention, sparse
from tfx.ops.attention.splash import splash_block, splash_mask

SPECS = {
    "causal": sparse.Causal(),
    "window": sparse.SlidingWindow(100),
    "strided": sparse.Strided(48),
    "fixed": sparse.Fixed(64, 8),
    "global": sparse.GlobalTokens(3),
    "random": sparse.RandomBlocks(64, 2, seed=3),
    "union": sparse.SlidingWindow(40) | sparse.GlobalTokens(2),
    "intersection": sparse.Causal() & (sparse.SlidingWindow(64) | sparse.RandomBlocks(128, 1)),
    "prefix_causal": sparse.LeadingKeys(sparse.Causal(), 5),
    "prefix_window": sparse.LeadingKeys(sparse.SlidingWindow(30), 3),
}
SLOW = pytest.mark.slow


def _inputs(q_len, kv_len, num_heads, num_kv_heads, head_dim=64, batch=2):
    keys = jax.random.split(jax.random.key(q_len + num_kv_heads), 4)
    query = jax.random.normal(keys[0], (batch, q_len, num_heads, head_dim))
    key, value = (jax.random.normal(k, (batch, kv_len, num_kv_heads, head_dim)) for k in keys[1:3])
    cotangent = jax.random.normal(keys[3], query.shape)
    return query, key, value, cotangent



def _assert_matches_reference(query, key, value, cotangent, **kwargs):
    splash_out, splash_grads = attention_values_and_grads("splash", query, key, value, cotangent,
                                   **kwargs)
    ref_out, ref_grads = attention_values_and_grads("reference", query, key, value, cotangent,
                                   **kwargs)
    np.testing.assert_allclose(splash_out, ref_out, atol=2e-5, rtol=2e-5)
    for name, got, want in zip("qkv", splash_grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.parametrize("name", [name if name == "causal" else pytest.param(name, marks=SLOW)
                                  for name in SPECS])
def test_every_spec_gqa_with_segments(name):
    """GQA (4 query heads per key head) over 384 keys: 3x3 tiles of 128, packed sequences."""
    query, key, value, cotangent = _inputs(384, 384, num_heads=4, num_kv_heads=1)
    segments = jnp.asarray([[0] * 200 + [1] * 184, [0] * 384], jnp.int32)
    _assert_matches_reference(query, key, value, cotangent, sparsity=SPECS[name],
                              query_segment_ids=segments)


@pytest.mark.parametrize("segmented", [False, pytest.param(True, marks=SLOW)])
def test_padding_masks_run_as_segment_ids(segmented):
    """A key-padding mask [batch, 1, 1, kv_len] (left padding in row 0, right in row 1, one row
    of packed sequences) gives the reference's values and gradients, and is picked
    automatically on a TPU."""
    query, key, value, cotangent = _inputs(256, 256, num_heads=2, num_kv_heads=1)
    valid = jnp.asarray([[False] * 40 + [True] * 216, [True] * 190 + [False] * 66])
    kwargs = {"mask": valid[:, None, None, :], "is_causal": True}
    if segmented:
        kwargs["query_segment_ids"] = jnp.asarray([[0] * 100 + [1] * 156, [5] * 256], jnp.int32)
    _assert_matches_reference(query, key, value, cotangent, **kwargs)
    case = backends.AttentionCase(dtype=jnp.bfloat16, q_len=256, kv_len=256, num_heads=2,
                                  num_kv_heads=1, head_dim=64, value_dim=64, has_mask=True,
                                  key_mask=True, spec=sparse.Causal())
    assert backends.select_attention("tpu", case) == "splash"


@SLOW
@pytest.mark.parametrize(("q_len", "kv_len", "num_heads", "num_kv_heads", "is_causal"), [
    (256, 256, 2, 2, True),  # MHA
    (128, 384, 4, 2, False),  # GQA cross-attention, no mask at all
    (384, 128, 2, 1, True),  # MQA, more queries than keys, top-left causal
])
def test_head_layouts_and_lengths(q_len, kv_len, num_heads, num_kv_heads, is_causal):
    query, key, value, cotangent = _inputs(q_len, kv_len, num_heads, num_kv_heads)
    _assert_matches_reference(query, key, value, cotangent, is_causal=is_causal, scale=0.3)


def test_rows_that_see_no_key_are_zero_with_zero_gradients():
    """Cross-attention segments where some queries' segment has no key: splash alone divides
    by zero there; the sink logit makes those rows zeros, as the reference defines."""
    query, key, value, cotangent = _inputs(128, 256, num_heads=2, num_kv_heads=2, batch=1)
    query_segments = jnp.asarray([[0] * 64 + [7] * 64], jnp.int32)
    key_segments = jnp.asarray([[0] * 256], jnp.int32)
    kwargs = {"query_segment_ids": query_segments, "key_segment_ids": key_segments,
              "is_causal": True}
    out, grads = attention_values_and_grads("splash", query, key, value, cotangent,
                                   **kwargs)
    assert np.all(np.asarray(out[:, 64:]) == 0)
    assert all(np.isfinite(g).all() for g in grads)
    assert np.all(np.asarray(grads[0][:, 64:]) == 0)
    _assert_matches_reference(query, key, value, cotangent, **kwargs)


@SLOW
def test_bfloat16_follows_the_reference():
    query, key, value, _ = (x.astype(jnp.bfloat16) for x in _inputs(256, 256, 2, 1))
    got = dot_product_attention(query, key, value, is_causal=True, implementation="splash")
    want = dot_product_attention(query, key, value, is_causal=True, implementation="reference")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=3e-2)


@pytest.mark.parametrize(("spec", "kind"), [
    (None, masks.FullMask),
    (sparse.Causal(), masks.CausalMask),
    (sparse.SlidingWindow(8), masks.LocalMask),
    (sparse.LeadingKeys(sparse.Causal(), 4), masks.CausalMask),
    (sparse.SlidingWindow(8) | sparse.GlobalTokens(2), masks.LogicalOr),
    (sparse.Causal() & sparse.SlidingWindow(8), masks.LogicalAnd),
    (sparse.Strided(4), masks.NumpyMask),
    (sparse.Strided(4) | sparse.GlobalTokens(2), masks.NumpyMask),  # all-dense parts: one array
])
def test_specs_map_to_lazy_masks_where_splash_has_them(spec, kind):
    assert type(splash_mask(spec, 48, 64)) is kind


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize(("q_len", "kv_len"), [(384, 384), (128, 384), (384, 128)])
def test_every_spec_maps_to_the_same_mask(name, q_len, kv_len):
    mask = splash_mask(SPECS[name], q_len, kv_len)
    np.testing.assert_array_equal(mask[0:q_len, 0:kv_len], SPECS[name].dense(q_len, kv_len))


def test_block_is_the_largest_tile_dividing_the_length():
    assert [splash_block(n) for n in (128, 256, 384, 512, 1536, 640)] == [128, 256, 128, 512,
                                                                          512, 128]
