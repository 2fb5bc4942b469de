"""The layer parts that today's open families are made of, each against its formula written out
here: q/k/v biases without an output bias (Qwen 2), query/key RMS norms per head (Qwen 3,
Gemma 3) and across heads (OLMo 2), norms on the branch outputs (Gemma 2/3 "sandwich", OLMo 2
outputs only), the parallel residual (GPT-NeoX), per-layer attention kinds with a local RoPE
base (Gemma 2/3), final logit soft-capping (Gemma 2), and dense first layers before the
experts (DeepSeek-V3). The family parity tests (tests/hf/) check the same parts against
transformers."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import Decoder, DecoderConfig
from tfx.models.block import Block
from tfx.nn import Attention, LatentAttention
from tfx.nn.mlp import MLP
from tfx.nn.moe import MoE
from tfx.ops import dot_product_attention

D, HEADS, KV, HEAD_DIM, SEQ = 32, 4, 2, 8, 10
EPS = 1e-6


def _x(seq=SEQ, seed=0):
    return jax.random.normal(jax.random.key(seed), (2, seq, D))


def _rms(x, scale):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + EPS) * np.asarray(scale)


def _perturb(module, seed=1):
    """Norm scales are ones and biases zeros at init: move every parameter so that they matter."""
    graph, state = nnx.split(module)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graph, jax.tree.unflatten(tree, leaves))


def test_qkv_bias_without_an_output_bias():
    attention = Attention(D, HEADS, num_kv_heads=KV, use_bias=False, qkv_bias=True,
                          rngs=nnx.Rngs(0))
    assert all(getattr(attention, name).bias is not None for name in ("query", "key", "value"))
    assert attention.out.bias is None


@pytest.mark.parametrize("kind", ["per_head", "across_heads"])
def test_qk_norm_against_the_formula(kind):
    attention = _perturb(Attention(D, HEADS, num_kv_heads=KV, head_dim=HEAD_DIM, qk_norm=kind,
                                   norm_eps=EPS, rngs=nnx.Rngs(0)))
    width = {"per_head": HEAD_DIM, "across_heads": None}[kind]
    x = _x()

    def project(linear, norm, heads):
        h = np.asarray(linear(x), np.float64)
        if width is None:  # the whole projection is one vector
            return _rms(h, norm.norm.scale[...]).reshape(2, SEQ, heads, HEAD_DIM)
        return _rms(h.reshape(2, SEQ, heads, HEAD_DIM), norm.norm.scale[...])

    q = project(attention.query, attention.query_norm, HEADS)
    k = project(attention.key, attention.key_norm, KV)
    v = np.asarray(attention.value(x)).reshape(2, SEQ, KV, HEAD_DIM)
    out = dot_product_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
                                is_causal=True)
    expected = attention.out(out.reshape(2, SEQ, HEADS * HEAD_DIM))
    chex.assert_trees_all_close(attention(x, is_causal=True), expected, atol=1e-5)
    shapes = (attention.query_norm.norm.scale.shape, attention.key_norm.norm.scale.shape)
    assert shapes == ({"per_head": ((HEAD_DIM,),) * 2,
                       "across_heads": ((HEADS * HEAD_DIM,), (KV * HEAD_DIM,))}[kind])


def _config(**overrides):
    return DecoderConfig(vocab_size=50, d_model=D, num_layers=2, num_heads=HEADS, d_ff=48,
                         max_len=64, position="rope", norm={"kind": "rms", "eps": EPS},
                         attention={"num_kv_heads": KV}, use_bias=False).replace(**overrides)


def _branches(block, x):
    """The block's attention and MLP as plain functions of their inputs."""
    def attention(h):
        return block.attention(h, is_causal=True)

    return attention, block.mlp


@pytest.mark.parametrize("norm, expected", [
    ({"outputs": True},  # Gemma 2/3: x + n2(f(n1(x)))
     lambda b, f, x: x + b.attention_output_norm(f(b.attention_norm(x)))),
    ({"outputs": True, "inputs": False},  # OLMo 2: x + n2(f(x))
     lambda b, f, x: x + b.attention_output_norm(f(x))),
])
def test_branch_output_norms(norm, expected):
    block = _perturb(Block(_config(norm=norm), rngs=nnx.Rngs(0)))
    x = _x()
    attention, mlp = _branches(block, x)
    h = expected(block, attention, x)
    mlp_input = block.mlp_norm(h) if block.mlp_norm is not None else h
    want = h + block.mlp_output_norm(mlp(mlp_input))
    chex.assert_trees_all_close(block(x, is_causal=True), want, atol=1e-5)
    assert (block.attention_norm is None) == (norm.get("inputs") is False)


def test_parallel_residual():
    block = _perturb(Block(_config(mlp={"parallel": True}), rngs=nnx.Rngs(0)))
    x = _x()
    attention, mlp = _branches(block, x)
    want = x + attention(block.attention_norm(x)) + mlp(block.mlp_norm(x))
    chex.assert_trees_all_close(block(x, is_causal=True), want, atol=1e-5)


def test_logit_softcap():
    capped = Decoder(_config(logit_softcap=0.2), rngs=nnx.Rngs(0))
    plain = Decoder(_config(), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (2, SEQ), 0, 50)
    raw = plain(ids)
    assert float(jnp.abs(raw).max()) > 0.2  # the cap must bind somewhere
    chex.assert_trees_all_close(capped(ids), 0.2 * jnp.tanh(raw / 0.2), atol=1e-6)
    hidden = capped.hidden_states(ids)
    chex.assert_trees_all_close(capped.logits(hidden, capped.output_weights()), capped(ids),
                                atol=1e-6)


MIXED = dict(attention={"num_kv_heads": KV, "sliding_window": 3,
                        "layer_types": ("sliding", "full")},
             rope={"theta": 1e4, "local_theta": 10.0})


def test_layer_types_give_each_layer_its_window_and_rope_base():
    model = Decoder(_config(**MIXED), rngs=nnx.Rngs(0))
    sliding, full = model.stack.layers
    assert model.stack.windows == (3, None)
    assert sliding.attention.position.theta == 10.0
    assert full.attention.position.theta == 1e4
    # The same weights as two full layers with theta 1e4 except layer 0: logits must differ.
    same = Decoder(_config(), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(3), (2, SEQ), 0, 50)
    assert not np.allclose(model(ids), same(ids), atol=1e-3)
    # Layer 0 alone: its window is the sliding window of a one-layer Mistral-like model.
    one = dict(num_layers=1, attention={"num_kv_heads": KV, "sliding_window": 3,
                                        "layer_types": ("sliding",)},
               rope={"theta": 10.0})
    windowed = Decoder(_config(**{**one, "attention": {"num_kv_heads": KV,
                                                       "sliding_window": 3}}), rngs=nnx.Rngs(0))
    chex.assert_trees_all_close(Decoder(_config(**one), rngs=nnx.Rngs(0))(ids), windowed(ids),
                                atol=1e-6)


def test_mixed_layers_decode_with_a_cache_like_the_full_sequence():
    model = Decoder(_config(**MIXED), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(4), (2, SEQ), 0, 50)
    mask = jnp.ones((2, SEQ), bool).at[1, 7:].set(False)
    cache = model.init_cache(2, 16)
    assert cache.window is None  # the full layer needs every key: a linear cache
    step = nnx.jit(lambda m, i, a, c: m(i, attention_mask=a, cache=c))
    outs = []
    for start, stop in [(0, 4)] + [(t, t + 1) for t in range(4, SEQ)]:
        logits, cache = step(model, ids[:, start:stop], mask[:, start:stop], cache)
        outs.append(logits)
    full = model(ids, attention_mask=mask)
    got = jnp.concatenate(outs, axis=1)
    chex.assert_trees_all_close(got[0], full[0], atol=2e-5)
    chex.assert_trees_all_close(got[1, :7], full[1, :7], atol=2e-5)


LATENT = dict(latent={"q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                      "qk_rope_head_dim": 4, "v_head_dim": 6},
              attention={"num_kv_heads": None}, rope={"layout": "interleaved"})


def test_latent_attention_decoder_decodes_with_its_latent_cache():
    model = Decoder(_config(**LATENT), rngs=nnx.Rngs(0))
    assert all(isinstance(layer.attention, LatentAttention) for layer in model.stack.layers)
    ids = jax.random.randint(jax.random.key(5), (2, SEQ), 0, 50)
    cache = model.init_cache(2, 16)
    assert cache.bytes_per_token == 2 * (16 + 4) * 4  # two layers of latent + rotary key
    step = nnx.jit(lambda m, i, c: m(i, cache=c))
    outs = []
    for start, stop in [(0, 4)] + [(t, t + 1) for t in range(4, SEQ)]:
        logits, cache = step(model, ids[:, start:stop], cache)
        outs.append(logits)
    chex.assert_trees_all_close(jnp.concatenate(outs, axis=1), model(ids), atol=2e-5)


def test_dense_first_layers():
    config = _config(num_layers=3, moe={"num_experts": 4, "experts_per_token": 2,
                                        "first_dense": 2, "d_ff": 16})
    model = Decoder(config, rngs=nnx.Rngs(0))
    kinds = [type(layer.mlp) for layer in model.stack.layers]
    assert kinds == [MLP, MLP, MoE]
    assert model.stack.layers[0].mlp.up.kernel.shape == (D, 48)


@pytest.mark.parametrize("bad, message", [
    (dict(attention={"layer_types": ("full",)}), "one per layer"),
    (dict(attention={"layer_types": ("sliding", "full")}), "sliding_window"),
    (dict(attention={"layer_types": ("full", "wide")}), "layer_types"),
    (dict(attention={"softcap": 0.0}), "attention.softcap"),
    (dict(logit_softcap=-1.0), "logit_softcap"),
    (dict(attention={"qk_norm": "per_token"}), "attention.qk_norm"),
    (dict(norm={"pre_norm": False, "outputs": True}), "pre-norm"),
    (dict(moe={"num_experts": 6, "num_groups": 4, "policy": "deepseek"}), "moe.num_groups"),
    (dict(moe={"num_experts": 8, "num_groups": 4}), "moe.policy 'deepseek'"),
    (dict(moe={"num_experts": 8, "num_groups": 4, "groups_per_token": 5,
               "policy": "deepseek"}), "moe.groups_per_token"),
    (dict(moe={"num_experts": 8, "num_groups": 4, "groups_per_token": 1,
               "experts_per_token": 3, "policy": "deepseek"}), "moe.experts_per_token"),
    (dict(moe={"first_dense": 1}, compute={"scan_layers": True}), "first_dense"),
    (dict(attention={"sliding_window": 3, "layer_types": ("sliding", "full")},
          compute={"scan_layers": True}), "mixes"),
    (dict(LATENT, position="alibi", rope=None), "position='rope'"),
    (dict(LATENT, attention={"num_kv_heads": 2}), "attention.num_kv_heads"),
])
def test_bad_part_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        _config(**bad)
