"""Tests for tfx.ops.positional.rope.

References: a written-out rotation with explicit 2x2 matrices (below), RoFormer's relative-position
property, HF's conversion of Meta LLaMA weights (a per-head permutation of the q/k features), and
the real Hugging Face transformers code (`modeling_rope_utils.ROPE_INIT_FUNCTIONS`,
`LlamaRotaryEmbedding` + `apply_rotary_pos_emb`, and GPT-NeoX's for partial rotary).
"""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops.positional.rope import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    NTKScaling,
    YaRNScaling,
    apply_rope,
    rope_frequencies,
)

LAYOUTS = ("half", "interleaved")
STATIC = ("theta", "layout", "scaling", "rotary_fraction")


def naive_rope(x, positions, *, theta, layout, rotary_dim):
    """Rotate each feature pair by an explicit 2x2 matrix, in float64, one token at a time."""
    x = np.asarray(x, np.float64)
    positions = np.broadcast_to(np.asarray(positions), x.shape[:2])
    out = x.copy()
    for i in range(rotary_dim // 2):
        pair = [i, i + rotary_dim // 2] if layout == "half" else [2 * i, 2 * i + 1]
        inv_freq = theta ** (-2 * i / rotary_dim)
        for b, s in np.ndindex(positions.shape):
            angle = positions[b, s] * inv_freq
            rotation = np.array([[math.cos(angle), -math.sin(angle)],
                                 [math.sin(angle), math.cos(angle)]])
            out[b, s][:, pair] = x[b, s][:, pair] @ rotation.T  # [heads, 2]
    return out


def interleaved_to_half(dim, rotary_dim):
    """Feature order that turns an interleaved-layout head into a half-layout one."""
    return np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2),
                           np.arange(rotary_dim, dim)])


def _normal(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


class ApplyRopeVariantsTest(chex.TestCase):
    """The raw function eagerly and under jit against the written-out 2x2 rotations."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(layout=LAYOUTS, rotary_fraction=(1.0, 0.5, 0.75))
    def test_matches_naive_rotation(self, layout, rotary_fraction):
        x = _normal(0, (2, 5, 3, 16))
        positions = jnp.array([[0, 1, 2, 3, 4], [7, 9, 30, 31, 60]])
        rope = self.variant(apply_rope.__wrapped__, static_argnames=STATIC)
        got = rope(x, positions, theta=500.0, layout=layout, rotary_fraction=rotary_fraction)
        want = naive_rope(x, positions, theta=500.0, layout=layout,
                          rotary_dim=int(16 * rotary_fraction))
        chex.assert_shape(got, x.shape)
        chex.assert_trees_all_close(np.asarray(got), want, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_dynamic_ntk_traced_and_concrete_length_agree(self):
        # Eager, the length is a concrete array; under jit it is traced: same frequencies.
        x = _normal(1, (1, 6, 2, 8))
        scaling = DynamicNTKScaling(factor=2.0, original_max_position_embeddings=4)
        positions = jnp.arange(6)
        rope = self.variant(apply_rope.__wrapped__, static_argnames=STATIC)
        got = rope(x, positions, scaling=scaling)
        inv_freq, _ = rope_frequencies(8, scaling=scaling, seq_len=6)
        theta = 10000.0 * (2.0 * 6 / 4 - 1) ** (8 / 6)
        np.testing.assert_allclose(inv_freq, theta ** (-np.arange(0, 8, 2) / 8), rtol=1e-6)
        want = naive_rope(x, positions, theta=theta, layout="half", rotary_dim=8)
        chex.assert_trees_all_close(np.asarray(got), want, atol=1e-5)


def _unit(seed, dim):
    v = _normal(seed, (dim,))
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 300), n=st.integers(0, 300), shift=st.integers(-300, 300))
def test_score_depends_only_on_offset(layout, m, n, shift):
    """RoFormer: <R_m q, R_n k> = <R_(m+s) q, R_(n+s) k> = <R_(m-n) q, k>."""
    q = jnp.broadcast_to(_unit(2, 32), (1, 3, 1, 32))
    k = jnp.broadcast_to(_unit(3, 32), (1, 3, 1, 32))
    rq = apply_rope(q, jnp.array([m, m + shift, m - n]), layout=layout)
    rk = apply_rope(k, jnp.array([n, n + shift, 0]), layout=layout)
    scores = np.asarray(jnp.sum(rq * rk, axis=-1)).ravel()
    np.testing.assert_allclose(scores, np.full(3, scores[0]), atol=2e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 6), heads=st.integers(1, 3),
       half_dim=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_rotation_keeps_norm_and_position_zero_is_identity(layout, batch, seq, heads, half_dim,
                                                           seed):
    x = _normal(seed, (batch, seq, heads, 2 * half_dim))
    positions = np.random.default_rng(seed).integers(0, 10_000, (2, batch, seq), np.int32)
    positions[1] = 0  # one compiled call: random positions, then all zeros
    rotated = np.asarray(apply_rope(np.stack([x, x]).reshape(2 * batch, seq, heads, -1),
                                    positions.reshape(2 * batch, seq), layout=layout))
    moved, at_zero = rotated[:batch], rotated[batch:]
    np.testing.assert_allclose(np.linalg.norm(moved, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    np.testing.assert_array_equal(at_zero, x)  # cos 0 = 1, sin 0 = 0 exactly


@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_meta_weight_permutation_turns_interleaved_into_half(rotary_fraction):
    """HF's Meta->HF LLaMA conversion permutes W_q/W_k rows within each head; with it, "half"
    RoPE of the permuted projections equals "interleaved" RoPE of the original ones (permuted)."""
    heads, head_dim, d_model = 2, 8, 12
    rotary_dim = int(head_dim * rotary_fraction)
    hidden = _normal(4, (2, 5, d_model))
    w_meta = _normal(5, (heads * head_dim, d_model))
    order = interleaved_to_half(head_dim, rotary_dim)
    w_hf = w_meta.reshape(heads, head_dim, d_model)[:, order].reshape(heads * head_dim, d_model)
    if rotary_fraction == 1.0:  # the reshape/transpose that HF's conversion script writes
        written = w_meta.reshape(heads, head_dim // 2, 2, d_model).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(w_hf, written.reshape(heads * head_dim, d_model))
    q_meta = (hidden @ w_meta.T).reshape(2, 5, heads, head_dim)
    q_hf = (hidden @ w_hf.T).reshape(2, 5, heads, head_dim)
    positions = jnp.array([3, 1, 4, 1, 5])
    meta = apply_rope(q_meta, positions, layout="interleaved", rotary_fraction=rotary_fraction)
    hf = apply_rope(q_hf, positions, layout="half", rotary_fraction=rotary_fraction)
    chex.assert_trees_all_close(hf, meta[..., order], atol=1e-6, rtol=0)


def test_bfloat16_in_bfloat16_out_close_to_float32():
    x = _normal(6, (2, 7, 3, 16))
    positions = jnp.arange(100, 107)
    want = apply_rope(x, positions, scaling=YaRNScaling(4.0, 64), rotary_fraction=0.5)
    got = apply_rope(x.astype(jnp.bfloat16), positions, scaling=YaRNScaling(4.0, 64),
                     rotary_fraction=0.5)
    assert got.dtype == jnp.bfloat16
    chex.assert_trees_all_close(got.astype(jnp.float32), want, atol=3e-2, rtol=1e-2)
    np.testing.assert_array_equal(got[..., 8:], x[..., 8:].astype(jnp.bfloat16))


def test_static_ntk_scales_the_lowest_frequency_by_the_factor():
    """bloc97's NTK-aware base theta·f^(d/(d-2)): highest frequency kept, lowest divided by f."""
    inv_freq, scale = rope_frequencies(16, theta=10000.0, scaling=NTKScaling(4.0))
    base = 10000.0 * 4.0 ** (16 / 14)
    np.testing.assert_allclose(inv_freq, base ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)
    unscaled, _ = rope_frequencies(16, theta=10000.0)
    np.testing.assert_allclose([inv_freq[0], inv_freq[-1]], [unscaled[0], unscaled[-1] / 4],
                               rtol=1e-6)
    assert scale == 1.0


def test_scaling_objects_are_hashable_frozen_and_normalised():
    assert YaRNScaling(4, 16) == YaRNScaling(4.0, 16)
    assert hash(YaRNScaling(4, 16)) == hash(YaRNScaling(4.0, 16))
    assert isinstance(LinearScaling(2).factor, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LinearScaling(2.0).factor = 3.0


# ---------------------------------------------------------------- parity with HF transformers

HEADS, HEAD_DIM, MAX_POS = 2, 16, 16

HF_CASES = {
    "default": ({"rope_type": "default"}, None),
    "linear": ({"rope_type": "linear", "factor": 4.0}, LinearScaling(4.0)),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, DynamicNTKScaling(3.0, MAX_POS)),
    "yarn": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8},
             YaRNScaling(8.0, 8)),
    "yarn_untruncated_betas": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
        YaRNScaling(4.0, 64, beta_fast=16.0, beta_slow=2.0, truncate=False)),
    "yarn_mscale": (
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
         "mscale": 1.0, "mscale_all_dim": 0.707},
        YaRNScaling(40.0, 64, mscale=1.0, mscale_all_dim=0.707)),
    "yarn_mscale_alone_is_ignored": (
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
         "mscale": 0.707},
        YaRNScaling(40.0, 64, mscale=0.707)),
    "yarn_attention_factor": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
         "attention_factor": 0.8},
        YaRNScaling(4.0, 64, attention_factor=0.8)),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               Llama3Scaling(8.0, 1.0, 4.0, 64)),
}


def _llama_config(rope_parameters, theta=10000.0, head_dim=HEAD_DIM):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=HEADS * head_dim, num_attention_heads=HEADS, head_dim=head_dim,
        max_position_embeddings=MAX_POS, rope_parameters={**rope_parameters, "rope_theta": theta})


def _hf_frequencies(config, seq_len=None):
    pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        init = LlamaRotaryEmbedding.compute_default_rope_parameters
    else:
        init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention_factor = init(config, seq_len=seq_len)
    return inv_freq.numpy(), attention_factor


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_frequencies_match_hf_init_functions(case):
    rope_parameters, scaling = HF_CASES[case]
    config = _llama_config(rope_parameters)
    want, want_factor = _hf_frequencies(config)
    got, got_factor = rope_frequencies(HEAD_DIM, scaling=scaling)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    if case.startswith("yarn_mscale"):  # the cases differ: the pair is a ratio, one is ignored
        expected = ((0.1 * math.log(40) + 1) / (0.1 * 0.707 * math.log(40) + 1)
                    if case == "yarn_mscale" else 0.1 * math.log(40) + 1)
        assert got_factor == pytest.approx(expected)


def test_llama31_frequencies_match_hf():
    """The published Llama 3.1 setting: theta 500000, head_dim 128, factor 8, 1, 4, 8192."""
    config = _llama_config({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                           theta=500000.0, head_dim=128)
    want, _ = _hf_frequencies(config)
    got, _ = rope_frequencies(128, theta=500000.0, scaling=Llama3Scaling(8.0))
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("seq_len", [5, MAX_POS, MAX_POS + 1, 3 * MAX_POS + 7])
def test_dynamic_frequencies_match_hf_at_each_length(seq_len):
    config = _llama_config(HF_CASES["dynamic"][0])
    want, _ = _hf_frequencies(config, seq_len=seq_len)
    scaling = HF_CASES["dynamic"][1]
    eager, _ = rope_frequencies(HEAD_DIM, scaling=scaling, seq_len=seq_len)
    traced = jax.jit(lambda n: rope_frequencies(HEAD_DIM, scaling=scaling, seq_len=n)[0])(seq_len)
    np.testing.assert_allclose(eager, want, rtol=1e-6)
    np.testing.assert_allclose(traced, want, rtol=1e-6)


def _hf_rotate(module, rotary, config, q, k, positions):
    torch = pytest.importorskip("torch")
    q, k = torch.from_numpy(np.asarray(q)), torch.from_numpy(np.asarray(k))
    position_ids = torch.from_numpy(np.asarray(positions, np.int64))
    cos, sin = rotary(config)(q, position_ids)
    q_out, k_out = module.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)  # [B, S, H, D]
    return q_out.numpy(), k_out.numpy()


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_apply_rope_matches_hf_llama(case):
    pytest.importorskip("torch")
    from transformers.models.llama import modeling_llama

    rope_parameters, scaling = HF_CASES[case]
    config = _llama_config(rope_parameters)
    q, k = _normal(7, (2, 9, HEADS, HEAD_DIM)), _normal(8, (2, 9, HEADS, HEAD_DIM))
    # Cached decoding: the second row sits at positions past MAX_POS (dynamic NTK grows the base).
    positions = np.stack([np.arange(9), np.arange(3 * MAX_POS, 3 * MAX_POS + 9)])
    want_q, want_k = _hf_rotate(modeling_llama, modeling_llama.LlamaRotaryEmbedding, config, q, k,
                                positions)
    got_q = apply_rope(q, jnp.asarray(positions), scaling=scaling)
    got_k = apply_rope(k, jnp.asarray(positions), scaling=scaling)
    chex.assert_trees_all_close((got_q, got_k), (want_q, want_k), atol=1e-5)


@pytest.mark.parametrize("rope_parameters,scaling", [
    ({"rope_type": "default", "partial_rotary_factor": 0.25}, None),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
      "partial_rotary_factor": 0.5}, YaRNScaling(4.0, 8)),
])
def test_partial_rotary_matches_hf_gpt_neox(rope_parameters, scaling):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.models.gpt_neox import modeling_gpt_neox

    fraction = rope_parameters["partial_rotary_factor"]
    config = transformers.GPTNeoXConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                        max_position_embeddings=MAX_POS,
                                        rope_parameters={**rope_parameters, "rope_theta": 10000.0})
    q, k = _normal(9, (2, 6, HEADS, HEAD_DIM)), _normal(10, (2, 6, HEADS, HEAD_DIM))
    positions = np.stack([np.arange(6), np.arange(20, 26)])
    want = _hf_rotate(modeling_gpt_neox, modeling_gpt_neox.GPTNeoXRotaryEmbedding, config, q, k,
                      positions)
    got = tuple(apply_rope(t, jnp.asarray(positions), scaling=scaling, rotary_fraction=fraction)
                for t in (q, k))
    chex.assert_trees_all_close(got, want, atol=1e-5)
    np.testing.assert_array_equal(got[0][..., int(HEAD_DIM * fraction):],
                                  q[..., int(HEAD_DIM * fraction):])


# ---------------------------------------------------------------- bad input

X = jnp.zeros((2, 5, 3, 8))
POSITIONS = jnp.arange(5)


@pytest.mark.parametrize("call,error,match", [
    (lambda: apply_rope(X, POSITIONS, layout="rotate_half"), ValueError,
     r"layout must be one of \('half', 'interleaved'\), got 'rotate_half'"),
    (lambda: apply_rope(jnp.zeros((1, 5, 1, 10)), POSITIONS, rotary_fraction=0.5), ValueError,
     r"rotary_dim = int\(head_dim \* rotary_fraction\) = int\(10 \* 0.5\) = 5 must be even"),
    (lambda: apply_rope(jnp.zeros((1, 5, 1, 7)), POSITIONS), ValueError, r"= 7 must be even"),
    (lambda: apply_rope(X, POSITIONS, rotary_fraction=0.2), ValueError,
     r"= 1 must be even and >= 2"),
    (lambda: apply_rope(X, POSITIONS, rotary_fraction=0.0), ValueError,
     r"rotary_fraction must be > 0, got 0.0"),
    (lambda: apply_rope(X, POSITIONS, rotary_fraction=1.5), ValueError,
     r"rotary_fraction must be in \(0, 1\], got 1.5"),
    (lambda: apply_rope(X, POSITIONS, rotary_fraction="all"), TypeError,
     r"rotary_fraction must be a number"),
    (lambda: apply_rope(X, jnp.arange(6)), ValueError,
     r"positions of shape \(6,\) must broadcast to \[batch, seq\] = \(2, 5\)"),
    (lambda: apply_rope(X, jnp.zeros((3, 5), jnp.int32)), ValueError,
     r"positions of shape \(3, 5\) must broadcast"),
    (lambda: apply_rope(X, jnp.zeros((2, 5, 1), jnp.int32)), ValueError,
     r"positions must have shape \[seq\] or \[batch, seq\], got \(2, 5, 1\)"),
    (lambda: apply_rope(X, POSITIONS.astype(jnp.float32)), TypeError,
     r"positions must have an integer dtype, got float32"),
    (lambda: apply_rope(X.astype(jnp.int32), POSITIONS), TypeError,
     r"x must have a floating dtype, got int32"),
    (lambda: apply_rope(X[0], POSITIONS), ValueError,
     r"x must have 4 dims \[batch, seq, heads, head_dim\], got shape \(5, 3, 8\)"),
    (lambda: apply_rope(X, POSITIONS, theta=-1.0), ValueError, r"theta must be > 0, got -1.0"),
    (lambda: apply_rope(X, POSITIONS, scaling="linear"), TypeError,
     r"scaling must be None or one of LinearScaling, NTKScaling, DynamicNTKScaling, "
     r"YaRNScaling, Llama3Scaling, ProportionalScaling, got str"),
    (lambda: rope_frequencies(8, scaling={"rope_type": "linear", "factor": 2.0}), TypeError,
     r"scaling must be None or one of .*, got dict"),
    (lambda: rope_frequencies(7), ValueError, r"rotary_dim must be even, got 7"),
    (lambda: rope_frequencies(0), ValueError, r"rotary_dim must be >= 2, got 0"),
    (lambda: rope_frequencies(2, scaling=NTKScaling(2.0)), ValueError,
     r"NTKScaling needs rotary_dim > 2 .*, got 2"),
    (lambda: apply_rope(jnp.zeros((1, 5, 1, 2)), POSITIONS,
                        scaling=DynamicNTKScaling(2.0, 4)), ValueError,
     r"DynamicNTKScaling needs rotary_dim > 2"),
    (lambda: rope_frequencies(8, theta=1.0, scaling=YaRNScaling(2.0, 8)), ValueError,
     r"YaRNScaling needs theta > 1"),
])
def test_bad_arguments_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("make,error,match", [
    (lambda: LinearScaling(0.0), ValueError, r"LinearScaling.factor must be > 0, got 0.0"),
    (lambda: LinearScaling("2"), TypeError, r"LinearScaling.factor must be a number, got str"),
    (lambda: NTKScaling(-2.0), ValueError, r"NTKScaling.factor must be > 0, got -2.0"),
    (lambda: DynamicNTKScaling(2.0, 0), ValueError,
     r"DynamicNTKScaling.original_max_position_embeddings must be >= 1, got 0"),
    (lambda: DynamicNTKScaling(2.0, 16.5), TypeError,
     r"DynamicNTKScaling.original_max_position_embeddings must be an int, got float"),
    (lambda: YaRNScaling(-4.0, 16), ValueError, r"YaRNScaling.factor must be > 0"),
    (lambda: YaRNScaling(4.0, 16, beta_fast=1.0, beta_slow=32.0), ValueError,
     r"YaRNScaling.beta_fast \(1.0\) must be greater than YaRNScaling.beta_slow \(32.0\)"),
    (lambda: YaRNScaling(4.0, 16, beta_slow=0.0), ValueError, r"YaRNScaling.beta_slow must be > 0"),
    (lambda: YaRNScaling(4.0, 16, attention_factor=-1.0), ValueError,
     r"YaRNScaling.attention_factor must be > 0, got -1.0"),
    (lambda: YaRNScaling(4.0, 16, mscale=0.0, mscale_all_dim=1.0), ValueError,
     r"YaRNScaling.mscale must be > 0, got 0.0"),
    (lambda: YaRNScaling(4.0, 16, mscale_all_dim="1"), TypeError,
     r"YaRNScaling.mscale_all_dim must be a number"),
    (lambda: YaRNScaling(4.0, 16, truncate="yes"), TypeError,
     r"YaRNScaling.truncate must be a bool, got str"),
    (lambda: Llama3Scaling(8.0, low_freq_factor=4.0, high_freq_factor=1.0), ValueError,
     r"Llama3Scaling.high_freq_factor \(1.0\) must be greater than "
     r"Llama3Scaling.low_freq_factor \(4.0\)"),
    (lambda: Llama3Scaling(8.0, low_freq_factor=0.0), ValueError,
     r"Llama3Scaling.low_freq_factor must be > 0, got 0.0"),
    (lambda: Llama3Scaling(8.0, original_max_position_embeddings=-1), ValueError,
     r"Llama3Scaling.original_max_position_embeddings must be >= 1, got -1"),
])
def test_bad_scaling_fields_raise(make, error, match):
    with pytest.raises(error, match=match):
        make()
