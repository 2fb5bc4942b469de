"""LoRA against x·W + scale·(x·a)·b written out, merge/unmerge, inits, counts and bad input."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import tfx
from tfx.models import DecoderConfig, create
from tfx.peft import LoRA, PeftParam, lora
from tfx.peft.lora_modules import LoRAEmbedding, LoRALinear

# A LLaMA-style decoder with GQA (4 query heads, 2 KV heads) and an untied head.
GQA = DecoderConfig(vocab_size=64, d_model=32, num_heads=4, attention={"num_kv_heads": 2}, d_ff=48,
                    num_layers=2, max_len=64, position="rope", norm={"kind": "rms"},
                    mlp={"activation": "silu", "gated": True}, use_bias=False,
                    embeddings={"tie": False})
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)), jnp.int32)
EVERYTHING = ("query", "key", "value", "out", "up", "gate", "down", "tokens", "head")


def _perturbed(model, scale=0.05, seed=0):
    """Give every LoRA factor random values (b is zero at init)."""
    graphdef, peft, rest = nnx.split(model, PeftParam, ...)
    leaves, tree = jax.tree.flatten(peft)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest)


def test_linear_forward_is_xw_plus_scaled_low_rank_product():
    linear = nnx.Linear(6, 5, use_bias=True, rngs=nnx.Rngs(0))
    a = jax.random.normal(jax.random.key(1), (6, 3))
    b = jax.random.normal(jax.random.key(2), (3, 5))
    adapted = LoRALinear(linear, a, b, scale=0.5)
    x = jax.random.normal(jax.random.key(3), (2, 4, 6))
    w, bias = np.asarray(linear.kernel[...]), np.asarray(linear.bias[...])
    expected = np.asarray(x) @ w + bias + 0.5 * (np.asarray(x) @ np.asarray(a)) @ np.asarray(b)
    np.testing.assert_allclose(adapted(x), expected, rtol=1e-5, atol=1e-5)


def test_embedding_lookup_and_tied_head_use_the_same_adapted_table():
    table = tfx.nn.TokenEmbedding(11, 4, rngs=nnx.Rngs(0))
    a = jax.random.normal(jax.random.key(1), (11, 2))
    b = jax.random.normal(jax.random.key(2), (2, 4))
    adapted = LoRAEmbedding(table, a, b, scale=2.0)
    full = np.asarray(table.table[...]) + 2.0 * np.asarray(a) @ np.asarray(b)
    ids = jnp.asarray([[0, 3, 10]])
    np.testing.assert_allclose(adapted(ids), full[np.asarray(ids)], rtol=1e-5, atol=1e-6)
    h = jax.random.normal(jax.random.key(3), (1, 3, 4))
    np.testing.assert_allclose(adapted.attend(h), np.asarray(h) @ full.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("init_style, scan_layers", [("peft", False), ("seed", False),
                                                     ("seed_normal", True)])
def test_attach_leaves_the_output_unchanged(init_style, scan_layers):
    model = create(GQA.replace(compute={"scan_layers": scan_layers}), rngs=nnx.Rngs(0))
    before = model(IDS)
    LoRA(rank=4, targets=EVERYTHING, init_style=init_style).attach(model, rngs=nnx.Rngs(1))
    chex.assert_trees_all_equal(model(IDS), before)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_merged_equals_unmerged_and_unmerge_restores_w(scan_layers):
    model = create(GQA.replace(compute={"scan_layers": scan_layers}), rngs=nnx.Rngs(0))
    original = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    LoRA(rank=4, alpha=8.0, targets=EVERYTHING).attach(model, rngs=nnx.Rngs(1))
    model = _perturbed(model)
    adapted_logits = model(IDS)
    weights = lora.detach(model)
    assert not lora.find_modules(model, (LoRALinear, LoRAEmbedding))
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, nnx.state(model, nnx.Param)), original)
    merged = lora.merge(nnx.state(model, nnx.Param), weights)
    merged_model = nnx.merge(nnx.graphdef(model), merged)
    np.testing.assert_allclose(merged_model(IDS), adapted_logits, atol=2e-5)
    restored = lora.unmerge(merged, weights)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, restored), original, atol=1e-6, rtol=0)


def test_delta_is_scale_times_a_b():
    state = nnx.state(create(GQA, rngs=nnx.Rngs(0)), nnx.Param)
    weights = lora.init(jax.random.key(0), state, rank=2, alpha=3.0, targets=["query"],
                        init_style="seed")
    weights = jax.tree.map(lambda x: x + 1.0, weights)  # b nonzero
    merged = lora.merge(state, weights)
    f = weights.factors["stack/layers/0/attention/query"]
    w0 = state["stack"]["layers"][0]["attention"]["query"]["kernel"][...]
    w1 = merged["stack"]["layers"][0]["attention"]["query"]["kernel"][...]
    np.testing.assert_allclose(w1 - w0, 1.5 * np.asarray(f.a) @ np.asarray(f.b), rtol=1e-5)


@pytest.mark.parametrize("rslora, expected", [(False, 16.0 / 4), (True, 16.0 / 2)])
def test_scale_is_alpha_over_r_or_sqrt_r(rslora, expected):
    assert LoRA(rank=4, alpha=16.0, rslora=rslora).scale == expected
    state = nnx.state(create(GQA, rngs=nnx.Rngs(0)), nnx.Param)
    weights = lora.init(jax.random.key(0), state, rank=4, alpha=16.0, targets=["query"],
                        rslora=rslora)
    assert weights.scale == expected


def test_initialisations_follow_peft_and_the_seed():
    state = nnx.state(create(GQA.replace(d_model=64, num_heads=4), rngs=nnx.Rngs(0)), nnx.Param)

    def factors(style):
        w = lora.init(jax.random.key(0), state, rank=8, alpha=8.0, init_style=style,
                      targets=["up", "tokens"], init_scale=0.05)
        return w.factors["stack/layers/0/mlp/up"], w.factors["embeddings/tokens"]

    (up, tokens) = factors("peft")  # kaiming-uniform(a=sqrt 5): bound 1/sqrt(d_in); B zero
    assert np.all(np.asarray(up.b) == 0) and np.abs(up.a).max() <= 1 / math.sqrt(64)
    assert np.abs(up.a).max() > 0.9 / math.sqrt(64)
    # peft's embedding LoRA zeroes A (our a) and draws B (our b) from N(0, 1)
    assert np.all(np.asarray(tokens.a) == 0)
    assert 0.8 < float(np.std(tokens.b)) < 1.2
    up, _ = factors("seed")  # uniform ±alpha/sqrt(r) on the input side, zero on the output
    assert np.all(np.asarray(up.b) == 0)
    bound = 0.05 / math.sqrt(8)
    assert bound * 0.9 < np.abs(up.a).max() <= bound
    up, _ = factors("seed_normal")
    assert np.all(np.asarray(up.b) == 0) and 0.04 < float(np.std(up.a)) < 0.06


def test_trainable_count_is_r_times_d_in_plus_d_out():
    model = create(GQA, rngs=nnx.Rngs(0))
    LoRA(rank=4, targets=("query", "key", "value", "out")).attach(model, rngs=nnx.Rngs(1))
    d, kv = 32, 2 * 8  # kv heads x head_dim
    per_layer = 4 * ((d + d) + (d + kv) + (d + kv) + (d + d))
    trainable, total = tfx.peft.count(model)
    assert trainable == GQA.num_layers * per_layer
    assert total == trainable + sum(x.size for x in jax.tree.leaves(
        nnx.state(create(GQA, rngs=nnx.Rngs(0)), nnx.Param)))


def test_only_peft_parameters_get_gradients_and_optimizer_state():
    model = create(GQA, rngs=nnx.Rngs(0))
    LoRA(rank=4, targets=("query", "value")).attach(model, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(_perturbed(model), nnx.Param)  # b = 0 would leave a still
    tx = tfx.peft.only_peft(optax.adam(1e-2), params)
    opt_state = tx.init(params)
    trainable, _ = tfx.peft.count(model)
    # adam: mu and nu of the PEFT parameters only (plus its step counter)
    assert sum(x.size for x in jax.tree.leaves(opt_state)) == 2 * trainable + 1

    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p)(IDS) ** 2)

    grads = jax.grad(loss)(params)
    updates, _ = tx.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    for (path, old), (_, after) in zip(nnx.to_flat_state(params), nnx.to_flat_state(new),
                                       strict=True):
        changed = not np.array_equal(old[...], after[...])
        assert changed == (path[-1] in ("lora_a", "lora_b")), path


def test_generation_with_lora_equals_the_merged_model():
    model = create(GQA, rngs=nnx.Rngs(0))
    LoRA(rank=4, targets=("query", "value", "head")).attach(model, rngs=nnx.Rngs(1))
    model = _perturbed(model, scale=0.2)
    assert model.output_weights() is None  # the adapted head is applied, not read as a matrix
    adapted = tfx.generate(model, IDS, max_new_tokens=6, temperature=0.0)
    weights = lora.detach(model)
    nnx.update(model, lora.merge(nnx.state(model, nnx.Param), weights))
    chex.assert_trees_all_equal(adapted, tfx.generate(model, IDS, max_new_tokens=6,
                                                      temperature=0.0))


def test_save_and_load_only_the_peft_parameters(tmp_path):
    settings = LoRA(rank=2, targets=("query", "tokens"))
    model = _perturbed(settings.attach(create(GQA, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1)))
    path = tmp_path / "lora.safetensors"
    tfx.peft.save(model, path, method=settings)
    fresh = tfx.peft.load(create(GQA, rngs=nnx.Rngs(0)), path)  # attaches from the metadata
    chex.assert_trees_all_equal(fresh(IDS), model(IDS))
    with pytest.raises(ValueError, match="holds PEFT parameters"):
        tfx.peft.load(LoRA(rank=2, targets=("value",)).attach(
            create(GQA, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1)), path)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        tfx.peft.load(model, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="no PEFT parameter file"):
        tfx.peft.load(model, tmp_path / "missing.safetensors")


def test_bad_input_is_refused_with_what_exists():
    model = create(GQA, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"match no module; adaptable modules: .*query"):
        LoRA(targets=("q_proj",)).attach(model, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        LoRA(rank=0)
    with pytest.raises(ValueError, match=r"rank must be in \[1, min\(d_in, d_out\)\]"):
        LoRA(rank=33, targets=("query",)).attach(model, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="init_style"):
        LoRA(init_style="xavier")
    with pytest.raises(ValueError, match="targets must be"):
        LoRA(targets=())
    LoRA(rank=2).attach(model, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="already has LoRA factors"):
        LoRA(rank=2).attach(model, rngs=nnx.Rngs(0))
