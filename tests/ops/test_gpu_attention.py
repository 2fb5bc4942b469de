"""GPU kernels without a GPU: the Pallas flash kernel in interpret mode against the reference
attention (values and gradients), and the cuDNN path's argument mapping, with
`jax.nn.dot_product_attention` replaced by a recorder that runs its XLA implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import attention_values_and_grads

from tfx.ops import dot_product_attention, sparse
from tfx.ops.attention import gpu as gpu_attention
from tfx.ops.attention.gpu import cudnn_mask


def _inputs(seq, num_heads, num_kv_heads, head_dim=64, batch=2, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seq * num_heads + num_kv_heads), 4)
    query = jax.random.normal(keys[0], (batch, seq, num_heads, head_dim), dtype)
    key, value = (jax.random.normal(k, (batch, seq, num_kv_heads, head_dim), dtype)
                  for k in keys[1:3])
    return query, key, value, jax.random.normal(keys[3], query.shape, dtype)



@pytest.mark.parametrize(("num_heads", "num_kv_heads", "is_causal", "segmented"), [
    (2, 2, True, False),  # MHA, causal
    (4, 2, False, True),  # GQA, packed sequences
    (2, 1, True, True),  # MQA, causal and packed
])
def test_pallas_gpu_matches_reference(num_heads, num_kv_heads, is_causal, segmented):
    """Interpret mode on CPU; 128 positions are one forward block and four backward blocks."""
    query, key, value, cotangent = _inputs(128, num_heads, num_kv_heads)
    kwargs = {"is_causal": is_causal, "scale": 0.2}
    if segmented:
        kwargs["query_segment_ids"] = jnp.asarray([[0] * 50 + [1] * 78, [3] * 128], jnp.int32)
    got_out, got_grads = attention_values_and_grads("pallas_gpu", query, key, value, cotangent,
                                   **kwargs)
    want_out, want_grads = attention_values_and_grads("reference", query, key, value, cotangent,
                                   **kwargs)
    np.testing.assert_allclose(got_out, want_out, atol=2e-5, rtol=2e-5)
    for name, got, want in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.parametrize(("spec", "expected"), [
    (None, (False, None)),
    (sparse.Causal(), (True, None)),
    (sparse.SlidingWindow(16), (True, 16)),
    (sparse.Causal() & sparse.SlidingWindow(16), (True, 16)),
    (sparse.SlidingWindow(8) & sparse.SlidingWindow(16), (True, 8)),
    (sparse.Strided(4), None),
    (sparse.SlidingWindow(8) | sparse.GlobalTokens(1), None),
    (sparse.Causal() & sparse.GlobalTokens(1), None),
])
def test_cudnn_mask(spec, expected):
    assert cudnn_mask(spec) == expected


@pytest.fixture
def recorded_cudnn(monkeypatch):
    """Replace jax.nn.dot_product_attention: record the call, answer with the XLA path."""
    calls = []
    original = jax.nn.dot_product_attention

    def record(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **{**kwargs, "implementation": "xla"})

    monkeypatch.setattr(jax.nn, "dot_product_attention", record)
    return calls


@pytest.mark.parametrize(("spec", "is_causal", "window"), [
    (None, False, None),
    (sparse.Causal(), True, None),
    (sparse.SlidingWindow(16), True, (15, 0)),  # jax counts the keys before the query only
    (sparse.Causal() & sparse.SlidingWindow(16), True, (15, 0)),
])
def test_cudnn_argument_mapping(recorded_cudnn, spec, is_causal, window):
    query, key, value, _ = _inputs(64, 4, 2, dtype=jnp.bfloat16)
    bias = jax.random.normal(jax.random.key(9), (4, 64, 64))
    out = gpu_attention.cudnn_attention(query, key, value, bias, spec, 0.25)
    (call,) = recorded_cudnn
    assert call["implementation"] == "cudnn"
    assert call["is_causal"] == is_causal and call["local_window_size"] == window
    assert call["scale"] == 0.25
    assert call["bias"].shape == (1, 4, 64, 64) and call["bias"].dtype == jnp.bfloat16
    want = dot_product_attention(query, key, value, bias=bias, sparsity=spec, scale=0.25,
                                 implementation="reference")
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=3e-2)


def test_gpu_platform_dispatches_half_precision_to_cudnn(recorded_cudnn, monkeypatch):
    """implementation=None on a (faked) GPU: bfloat16 causal attention goes to cuDNN."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    dot_product_attention.clear_cache()  # traces made on the CPU platform must not be reused
    query, key, value, _ = _inputs(48, 2, 1, dtype=jnp.bfloat16, batch=1)
    try:
        out = dot_product_attention(query, key, value, is_causal=True)
    finally:
        dot_product_attention.clear_cache()
    (call,) = recorded_cudnn
    assert call["implementation"] == "cudnn" and call["is_causal"] is True
    want = dot_product_attention(query, key, value, is_causal=True, implementation="reference")
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=3e-2)
