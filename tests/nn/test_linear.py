"""Every projection of tfx's models is a tfx.nn.linear.Linear computing its product with
tfx.ops.matmul.flat_dot_general, LoRA and quantization keep it, a Linear's values and gradients
are nnx.Linear's, and a model's outputs are those of the same weights with lax.dot_general."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.nn.linear import Linear, flat_linear, is_plain
from tfx.ops.matmul import flat_dot_general
from tfx.peft.core import find_modules


def small(preset):
    """A one-layer, width-32 version of the preset's architecture."""
    sizes = dict(d_model=32, d_ff=64, num_heads=2, num_layers=1)
    return {**sizes, "num_decoder_layers": 1} if preset == "t5-small" else sizes


@pytest.mark.parametrize("preset", ["char-gpt", "char-moe", "gpt2-small", "minilm-l6",
                                    "t5-small"])
def test_every_linear_is_flat(preset):
    model = tfx.models.create(preset, rngs=nnx.Rngs(0), **small(preset))
    linears = find_modules(model, nnx.Linear)
    assert linears, preset
    assert {path: m.dot_general for path, m in linears} == \
        {path: flat_dot_general for path, _ in linears}
    assert all(type(m) is Linear for _, m in linears), {type(m) for _, m in linears}


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_values_and_gradients_equal_nnx_linear(dtype, use_bias):
    ours = flat_linear(6, 5, use_bias=use_bias, dtype=dtype, rngs=nnx.Rngs(0),
                       bias_init=nnx.initializers.normal(1.0))
    theirs = nnx.Linear(6, 5, use_bias=use_bias, dtype=dtype, rngs=nnx.Rngs(0),
                        bias_init=nnx.initializers.normal(1.0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4, 6)), jnp.float32)

    def loss(module, x):
        return jnp.sum(jnp.sin(module(x).astype(jnp.float32)))

    chex.assert_trees_all_equal(ours(x), theirs(x))
    grads = [nnx.grad(loss, argnums=(0, 1))(m, x) for m in (ours, theirs)]
    tolerance = 1e-6 if dtype is None else 2e-2
    chex.assert_trees_all_close(nnx.state(grads[0][0]), nnx.state(grads[1][0]),
                                atol=tolerance, rtol=tolerance)
    chex.assert_trees_all_close(grads[0][1], grads[1][1], atol=tolerance, rtol=tolerance)


def test_is_plain_tells_plain_layers_from_their_lora_and_quantized_forms():
    pytest.importorskip("qwix")
    model = tfx.models.create("char-gpt", rngs=nnx.Rngs(0), **small("char-gpt"))
    assert all(is_plain(m) for _, m in find_modules(model, nnx.Linear))
    assert is_plain(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    tfx.peft.LoRA(rank=2, targets=("query",)).attach(tfx.quant.quantize(model, "int8"),
                                                     rngs=nnx.Rngs(1))
    kinds = {type(m).__name__: is_plain(m) for _, m in find_modules(model, nnx.Linear)}
    assert len(kinds) == 2 and not any(kinds.values()), kinds


def test_decoder_logits_equal_lax_dot_general():
    model = tfx.models.create("gpt2-small", rngs=nnx.Rngs(0), **small("gpt2-small"))
    model.eval()  # no dropout
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (2, 7)), jnp.int32)
    flat = model(ids)
    for _, module in find_modules(model, nnx.Linear):
        module.dot_general = jax.lax.dot_general
    chex.assert_trees_all_close(flat, model(ids), atol=1e-6, rtol=1e-6)


def test_lora_and_quantized_layers_keep_the_flat_product():
    pytest.importorskip("qwix")
    model = tfx.quant.quantize(tfx.models.create("char-gpt", rngs=nnx.Rngs(0),
                                                 **small("char-gpt")), "int8")
    tfx.peft.LoRA(rank=2, targets=("query", "value")).attach(model, rngs=nnx.Rngs(1))
    kinds = {type(m).__name__: m.dot_general for _, m in find_modules(model, nnx.Linear)}
    assert set(kinds) >= {"QuantizedLinear"} and len(kinds) >= 2, kinds
    assert set(kinds.values()) == {flat_dot_general}
