"""adapters_off: the model with LoRA switched off computes exactly the model before LoRA was
attached (after training-like, non-zero factors), under jit and grad, sharing the weights; other
PEFT methods and plain models are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import DecoderConfig, create
from tfx.peft import Adapters, LoRA, PeftParam, Prefix, SoftPrompt, adapters_off

# A LLaMA-style decoder with GQA and an untied head, so that every kind of target (attention,
# MLP, embedding, head) is adapted.
SMALL = DecoderConfig(vocab_size=48, d_model=16, num_heads=2, attention={"num_kv_heads": 1},
                      d_ff=24, num_layers=2, max_len=32, position="rope", norm={"kind": "rms"},
                      mlp={"activation": "silu", "gated": True}, use_bias=False,
                      embeddings={"tie": False})
EVERYTHING = ("query", "key", "value", "out", "up", "gate", "down", "tokens", "head")
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 48, (2, 7)), jnp.int32)


def _trained_lora(scan_layers: bool):
    """(model with LoRA on every target and random non-zero factors, its logits before LoRA)."""
    model = create(SMALL, compute={"scan_layers": scan_layers}, rngs=nnx.Rngs(0))
    before = model(IDS)
    LoRA(rank=2, targets=EVERYTHING).attach(model, rngs=nnx.Rngs(1))
    for index, (_, factor) in enumerate(nnx.to_flat_state(nnx.state(model, PeftParam))):
        factor[...] = 0.2 * jax.random.normal(jax.random.key(index), factor.shape)
    return model, before


@pytest.mark.parametrize("scan_layers", [False, True])
def test_switched_off_model_computes_the_model_before_lora(scan_layers):
    model, before = _trained_lora(scan_layers)
    adapted = model(IDS)
    assert float(jnp.abs(adapted - before).max()) > 1e-2  # the factors do change the logits
    reference = adapters_off(model)
    np.testing.assert_array_equal(reference(IDS), before)
    assert not jax.tree.leaves(nnx.state(reference, PeftParam))
    np.testing.assert_array_equal(model(IDS), adapted)  # the model keeps its factors
    # the same weight arrays (no copy) in new Variables
    weights = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(reference, nnx.Param)):
        assert variable is not weights[path]
        assert variable.get_value() is weights[path].get_value()

    graphdef, state = nnx.split(model)
    jitted = jax.jit(lambda s: adapters_off(nnx.merge(graphdef, s))(IDS))
    np.testing.assert_allclose(jitted(state), before, rtol=1e-6, atol=1e-6)


def test_the_reference_leaks_no_gradient_into_the_factors():
    model, _ = _trained_lora(scan_layers=False)
    graphdef, peft, rest = nnx.split(model, PeftParam, ...)

    def loss(p):
        m = nnx.merge(graphdef, p, rest)
        return (m(IDS) - jax.lax.stop_gradient(adapters_off(m)(IDS))).sum()

    grads = jax.grad(loss)(peft)
    direct = jax.grad(lambda p: nnx.merge(graphdef, p, rest)(IDS).sum())(peft)
    for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direct), strict=True):
        np.testing.assert_allclose(g, d, rtol=1e-6, atol=1e-6)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    # and without stop_gradient the switched-off model depends on no factor at all
    off = jax.grad(lambda p: adapters_off(nnx.merge(graphdef, p, rest))(IDS).sum())(peft)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(off))


def test_eval_mode_of_the_reference_leaves_the_model_alone():
    model = create(SMALL, dropout=0.1, rngs=nnx.Rngs(0))
    LoRA(rank=2).attach(model, rngs=nnx.Rngs(1))
    model.train()
    adapters_off(model).eval()
    assert model.stack.layers[0].dropout.deterministic is False
    assert model.stack.layers[0].attention.query.lora_dropout.deterministic is False


@pytest.mark.parametrize("method, name", [
    (SoftPrompt(num_tokens=2), "SoftPrompt"), (Prefix(num_tokens=2), "Prefix"),
    (Adapters(size=4), "Adapters")])
def test_other_methods_are_refused_by_name(method, name):
    model = create(SMALL, rngs=nnx.Rngs(0))
    method.attach(model, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=f"LoRA only.*{name} \\("):
        adapters_off(model)
    LoRA(rank=2).attach(model, rngs=nnx.Rngs(2))  # LoRA beside them does not make it possible
    with pytest.raises(ValueError, match=name):
        adapters_off(model)


def test_a_model_without_lora_is_refused():
    with pytest.raises(ValueError, match="no LoRA factors"):
        adapters_off(create(SMALL, rngs=nnx.Rngs(0)))
