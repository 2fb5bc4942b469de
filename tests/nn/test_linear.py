"""Every projection of tfx's models computes its product with tfx.ops.matmul.flat_dot_general,
LoRA and quantization keep it, and a model's outputs are those of the same weights with
lax.dot_general."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
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
