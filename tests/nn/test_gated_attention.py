"""Output-gated attention (`tfx.nn.Attention(output_gate=True)`) and the gated shared expert
(`tfx.nn.MoE(shared_gate=True)`), Qwen3-Next's and Qwen3.5's parts, against the formulas
written out here: out = o(attention(x) · sigmoid(x · W_g)) and
moe(x) = routed(x) + sigmoid(x · w) · shared(x)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx.peft
from tfx.nn.attention import Attention
from tfx.nn.moe import MoE


def _naive_causal_attention(attention: Attention, x: np.ndarray) -> np.ndarray:
    """Softmax attention over the projections of `attention`, heads concatenated, before the
    output projection: [batch, seq, heads · head_dim] (MHA, no positions)."""
    def heads(kernel):
        out = x @ np.asarray(kernel)
        return out.reshape(*x.shape[:2], attention.num_heads, attention.head_dim)

    q, k, v = (heads(m.kernel[...]) for m in (attention.query, attention.key, attention.value))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(attention.head_dim)
    seq = x.shape[1]
    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(*x.shape[:2], -1)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_output_gate_multiplies_each_heads_output_before_the_projection():
    attention = Attention(32, 4, output_gate=True, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(2, 7, 32)).astype(np.float32)
    gate = _sigmoid(x @ np.asarray(attention.gate.kernel[...]))
    want = (_naive_causal_attention(attention, x) * gate) @ np.asarray(attention.out.kernel[...])
    got = attention(jnp.asarray(x), is_causal=True)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_without_the_option_there_is_no_gate():
    attention = Attention(32, 4, rngs=nnx.Rngs(0))
    assert attention.gate is None
    x = np.random.default_rng(1).normal(size=(1, 5, 32)).astype(np.float32)
    want = _naive_causal_attention(attention, x) @ np.asarray(attention.out.kernel[...])
    chex.assert_trees_all_close(attention(jnp.asarray(x), is_causal=True), want, atol=1e-5,
                                rtol=1e-5)


def test_lora_can_target_the_gate():
    attention = Attention(32, 4, output_gate=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (1, 5, 32))
    before = attention(x, is_causal=True)
    tfx.peft.LoRA(rank=2, alpha=4.0, targets=("gate",)).attach(attention, rngs=nnx.Rngs(1))
    chex.assert_trees_all_close(attention(x, is_causal=True), before, atol=1e-6)
    nnx.update(attention, jax.tree.map(lambda p: p + 0.5,
                                       nnx.state(attention, tfx.peft.PeftParam)))
    assert not np.allclose(attention(x, is_causal=True), before)


def test_shared_gate_scales_the_shared_expert_per_token():
    kwargs = dict(num_experts=4, experts_per_token=2, shared_experts=2)
    gated = MoE(16, 8, shared_gate=True, **kwargs, rngs=nnx.Rngs(0))
    plain = MoE(16, 8, **kwargs, rngs=nnx.Rngs(0))  # the same weights (made first), no gate
    gated.eval(), plain.eval()
    x = jax.random.normal(jax.random.key(3), (2, 5, 16))
    shared = gated.shared(x)
    gate = _sigmoid(np.asarray(x) @ np.asarray(gated.shared_gate.kernel[...]))  # [2, 5, 1]
    want = np.asarray(plain(x)) - np.asarray(shared) + gate * np.asarray(shared)
    chex.assert_trees_all_close(gated(x), want, atol=1e-5, rtol=1e-5)
    assert gated.shared_gate.kernel.shape == (16, 1)


def test_a_shared_gate_needs_shared_experts():
    with pytest.raises(ValueError, match=r"shared_gate .* needs shared_experts >= 1, got 0"):
        MoE(16, 8, num_experts=4, experts_per_token=2, shared_gate=True, rngs=nnx.Rngs(0))
