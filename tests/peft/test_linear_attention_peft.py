"""PEFT on a hybrid model (Gated DeltaNet layers beside attention, Qwen3-Next's layout): the
linear-attention projections are LoRA targets like attention's, adapted forward and decoding
equal the merged model, gradients reach them, and the methods that act on whole layers
(bottleneck adapters, multi-LoRA, prefix on the attention layers) run on it."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.models import DecoderConfig, create
from tfx.peft import LoRA, PeftParam, Prefix, lora
from tfx.peft.lora_modules import LoRALinear

HYBRID = DecoderConfig(
    vocab_size=64, d_model=32, num_layers=4, num_heads=4, d_ff=48, max_len=64, position="rope",
    norm={"kind": "rms"}, mlp={"activation": "silu", "gated": True}, use_bias=False,
    attention={"num_kv_heads": 2, "layer_types": ("linear", "linear", "linear", "full")},
    linear={"heads": 4, "key_heads": 2, "key_dim": 8, "value_dim": 8, "chunk_size": 4})
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
# Gated DeltaNet's projections: queries, keys, values, the output gate, the step sizes β, the
# decay rates, and the output.
LINEAR_PROJECTIONS = ("query", "key", "value", "gate", "beta", "decay", "out")


def _perturbed(model, scale=0.1, seed=0):
    """Random values in every PEFT parameter (LoRA's b starts at zero)."""
    graphdef, peft, rest = nnx.split(model, PeftParam, ...)
    leaves, tree = jax.tree.flatten(peft)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest)


def _adapted(targets=LINEAR_PROJECTIONS):
    model = create(HYBRID, rngs=nnx.Rngs(0))
    LoRA(rank=2, alpha=4.0, targets=targets).attach(model, rngs=nnx.Rngs(1))
    return _perturbed(model)


def test_every_linear_attention_projection_is_a_lora_target():
    model = _adapted(r"stack/layers/\d+/attention/\w+")
    adapted = {tfx.nn.paths.path_name(p) for p, _ in lora.find_modules(model, LoRALinear)}
    for i in range(3):  # the linear layers: all seven projections
        assert {f"stack/layers/{i}/attention/{n}" for n in LINEAR_PROJECTIONS} <= adapted
    assert {f"stack/layers/3/attention/{n}" for n in ("query", "key", "value", "out")} <= adapted


def test_adapted_forward_and_decoding_equal_the_merged_model():
    model = _adapted()
    logits = model(IDS)
    tokens = tfx.generate(model, IDS, max_new_tokens=5, temperature=0.0)
    weights = lora.detach(model)
    before = model(IDS)
    nnx.update(model, lora.merge(nnx.state(model, nnx.Param), weights))
    np.testing.assert_allclose(model(IDS), logits, atol=2e-5)
    assert not np.allclose(before, logits, atol=1e-3)  # the factors did change the model
    chex.assert_trees_all_equal(tfx.generate(model, IDS, max_new_tokens=5, temperature=0.0),
                                tokens)


def test_gradients_reach_the_linear_attention_factors():
    model = _adapted(("beta", "decay", "gate"))
    graphdef, peft, rest = nnx.split(model, PeftParam, ...)

    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p, rest)(IDS) ** 2)

    grads = nnx.to_flat_state(jax.grad(loss)(peft))
    # a and b of beta, decay and gate in the 3 linear layers, and of the 4 MLPs' gates
    assert len(grads) == 2 * (3 * 3 + 4)
    for path, grad in grads:
        assert np.abs(np.asarray(grad[...])).max() > 0, path


def test_prefix_tuning_prefixes_the_attention_layers_and_leaves_linear_ones():
    model = create(HYBRID, rngs=nnx.Rngs(0))
    Prefix(num_tokens=3).attach(model, rngs=nnx.Rngs(1))
    prefixed = [tfx.nn.paths.path_name(p)
                for p, _ in lora.find_modules(model, tfx.peft.prefix.Prefixed)]
    assert prefixed == ["stack/layers/3/attention"]
    model = _perturbed(model)
    full = model(IDS)
    tokens = tfx.generate(model, IDS, max_new_tokens=4, temperature=0.0)
    assert full.shape == (2, 9, 64) and tokens.shape == (2, 13)


def test_a_prefix_named_on_a_linear_layer_is_refused():
    model = create(HYBRID, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="stack/layers/0/attention"):
        Prefix(num_tokens=3, targets=("stack/layers/0/attention",)).attach(
            model, rngs=nnx.Rngs(1))
