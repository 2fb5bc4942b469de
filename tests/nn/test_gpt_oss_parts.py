"""GPT-OSS's layer parts as modules: tfx.nn.MoE with a router bias, expert biases and the
clamped SwiGLU against transformers' GptOssMLP on the same weights (every dispatch that runs on
CPU); tfx.nn.Attention's sinks, through a dense and a paged KV cache; the settings refused."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import DecoderConfig
from tfx.nn import Attention
from tfx.nn.caches import PagedLayer
from tfx.nn.moe import MoE
from tfx.ops.paged import init_paged_cache

D_MODEL, D_FF, EXPERTS = 8, 6, 4


def _gpt_oss_mlp(torch, seed=0):
    """transformers' GptOssMLP (4 experts, top 2, limit 7) with N(0, 1.5²) weights: large
    enough that the clamps matter."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(hidden_size=D_MODEL, intermediate_size=D_FF,
                          num_local_experts=EXPERTS, num_experts_per_tok=2)
    mlp = modeling.GptOssMLP(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in mlp.parameters():
            tensor.copy_(1.5 * torch.randn(tensor.shape, generator=generator))
    return mlp


def _load(moe: MoE, hf) -> MoE:
    """hf's router (weight [E, d], bias), experts (gate_up_proj [E, d, 2f] with gate and up
    columns interleaved, its bias [E, 2f], down_proj [E, f, d] and bias) into `moe`."""
    def array(tensor):
        return jnp.asarray(tensor.detach().numpy())

    moe.router.kernel[...], moe.router.bias[...] = array(hf.router.weight).T, array(hf.router.bias)
    experts, theirs = moe.experts, hf.experts
    gate_up, bias = array(theirs.gate_up_proj), array(theirs.gate_up_proj_bias)
    experts.gate[...], experts.up[...] = gate_up[..., ::2], gate_up[..., 1::2]
    experts.gate_bias[...], experts.up_bias[...] = bias[..., ::2], bias[..., 1::2]
    experts.down[...] = array(theirs.down_proj)
    experts.down_bias[...] = array(theirs.down_proj_bias)
    return moe


@pytest.mark.parametrize("dispatch", ["onehot", "sorted", "ragged"])
def test_moe_equals_transformers_gpt_oss_mlp(dispatch):
    torch = pytest.importorskip("torch")
    hf = _gpt_oss_mlp(torch)
    moe = _load(MoE(D_MODEL, D_FF, num_experts=EXPERTS, experts_per_token=2, renormalize=True,
                    router_bias=True, expert_bias=True, swiglu_limit=7.0,
                    implementation=dispatch, rngs=nnx.Rngs(0)), hf)
    x = torch.randn(2, 5, D_MODEL, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(x)[0].numpy()
    np.testing.assert_allclose(moe(jnp.asarray(x.numpy())), expected, rtol=1e-5, atol=1e-4)
    # Without the clamp (a limit no value reaches) the outputs differ: the clamp mattered.
    loose = MoE(D_MODEL, D_FF, num_experts=EXPERTS, experts_per_token=2, renormalize=True,
                router_bias=True, expert_bias=True, swiglu_limit=1e6, rngs=nnx.Rngs(0))
    assert np.abs(np.asarray(_load(loose, hf)(jnp.asarray(x.numpy()))) - expected).max() > 1e-2


def test_biases_are_parameters_zero_at_init():
    moe = MoE(D_MODEL, D_FF, num_experts=EXPERTS, experts_per_token=2, router_bias=True,
              expert_bias=True, rngs=nnx.Rngs(0))
    shapes = {name: getattr(moe.experts, name).shape for name in ("gate_bias", "up_bias",
                                                                   "down_bias")}
    assert shapes == {"gate_bias": (4, 6), "up_bias": (4, 6), "down_bias": (4, 8)}
    assert moe.router.bias.shape == (4,) and not np.asarray(moe.router.bias[...]).any()
    plain = MoE(D_MODEL, D_FF, num_experts=EXPERTS, experts_per_token=2, rngs=nnx.Rngs(0))
    assert plain.router.bias is None and plain.experts.down_bias is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(swiglu_limit=7.0, gated=False), "gated 'silu' experts"),
    (dict(swiglu_limit=7.0, activation="gelu"), "gated 'silu' experts"),
    (dict(expert_bias=True, shared_experts=1), "expert_bias apply to the routed experts only"),
    (dict(swiglu_limit=-1.0), r"ClampedSwiGLU\.limit must be > 0"),
])
def test_bad_expert_forms_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoE(D_MODEL, D_FF, num_experts=EXPERTS, experts_per_token=2, rngs=nnx.Rngs(0), **kwargs)


def _attention(seed=0):
    attention = Attention(16, 4, num_kv_heads=2, sinks=True, use_bias=True, rngs=nnx.Rngs(seed))
    assert attention.sinks.shape == (4,) and not np.asarray(attention.sinks[...]).any()
    attention.sinks[...] = jnp.asarray([2.0, -1.0, 0.5, 4.0])
    return attention


def test_sinks_take_weight_from_the_keys():
    """Sink logits far below every score change nothing; far above, every head's output is
    zero, which leaves the output projection's bias."""
    attention = _attention()
    without = Attention(16, 4, num_kv_heads=2, use_bias=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 16))
    attention.sinks[...] = jnp.full((4,), -30.0)
    chex.assert_trees_all_close(attention(x, is_causal=True), without(x, is_causal=True),
                                atol=1e-6)
    attention.sinks[...] = jnp.full((4,), 30.0)
    bias = jnp.broadcast_to(attention.out.bias[...], (2, 6, 16))
    chex.assert_trees_all_close(attention(x, is_causal=True), bias, atol=1e-6)


def test_sinks_through_a_paged_cache_equal_the_full_sequence():
    """Prefill two rows (one padded) through a paged cache: the same outputs as the causal
    call on the whole sequence, at the real tokens."""
    attention = _attention()
    x = jax.random.normal(jax.random.key(2), (2, 7, 16))
    valid = jnp.arange(7)[None] < jnp.asarray([[7], [5]])
    cache = init_paged_cache(num_layers=1, num_pages=6, page_size=4, batch=2, pages_per_seq=2,
                             num_kv_heads=2, head_dim=4)
    cache = dataclasses.replace(cache, page_table=jnp.asarray([[3, 0], [5, 1]], jnp.int32))
    step, cache = cache.plan(valid)
    for implementation in ("reference", "blocked"):
        attention.implementation = implementation
        out, _ = attention(x, cache=PagedLayer(cache.layers[0], step))
        expected = attention(x, is_causal=True)
        np.testing.assert_allclose(np.asarray(out)[np.asarray(valid)],
                                   np.asarray(expected)[np.asarray(valid)], rtol=1e-5, atol=1e-5)


def test_latent_attention_refuses_sinks():
    with pytest.raises(ValueError, match=r"attention\.sinks is not implemented for latent"):
        DecoderConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=4, d_ff=32,
                      position="rope", latent={}, attention={"sinks": True})
