"""Tests for tfx.peft.core's extensions: methods compose with each other and with
rematerialised layers, `detach` restores the plain model, and PEFT files written before the
soft prompt moved into the embeddings still load."""

import chex
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from tfx import peft
from tfx.models import create
from tfx.models.block import Block, RematBlock
from tfx.models.stack import Embeddings
from tfx.nn import Attention
from tfx.peft import adapters, prefix, prompt
from tfx.peft.adapters import Adapted
from tfx.peft.prefix import Prefixed

SMALL = dict(vocab_size=40, d_model=32, num_layers=2, num_heads=4, d_ff=48, dropout=0.0)
IDS = jnp.arange(12).reshape(2, 6) % 40


def _model(**changes):
    return create("char-gpt", rngs=nnx.Rngs(0), **SMALL, **changes)


def test_adapters_on_rematerialised_layers_keep_both():
    plain, remat = _model(), _model(compute={"remat": True})
    for model in (plain, remat):
        peft.Adapters(size=4).attach(model, rngs=nnx.Rngs(1))
        peft.Prefix(num_tokens=2).attach(model, rngs=nnx.Rngs(2))
    block = remat.stack.layers[0]
    assert isinstance(block, Adapted) and isinstance(block, RematBlock)
    assert isinstance(block.attention, Prefixed)

    def loss(model):
        return jnp.mean(model(IDS) ** 2)

    chex.assert_trees_all_close(loss(remat), loss(plain), rtol=1e-6)
    chex.assert_trees_all_close(nnx.grad(loss)(remat), nnx.grad(loss)(plain), atol=1e-6)


def test_detach_restores_the_plain_model_and_its_logits():
    model = _model()
    before, state = model(IDS), nnx.state(model)
    peft.Prefix(num_tokens=2).attach(model, rngs=nnx.Rngs(1))
    peft.Adapters(size=4).attach(model, rngs=nnx.Rngs(2))
    peft.SoftPrompt(num_tokens=3).attach(model, rngs=nnx.Rngs(3))
    assert not np.allclose(model(IDS), before)
    prefix.detach(adapters.detach(prompt.detach(model)))
    block = model.stack.layers[0]
    assert type(block) is Block and type(block.attention) is Attention
    assert type(model.embeddings) is Embeddings
    assert not hasattr(block.attention, "prefix") and not hasattr(block, "mlp_adapter")
    chex.assert_trees_all_equal(nnx.state(model), state)
    chex.assert_trees_all_equal(model(IDS), before)


def test_a_soft_prompt_file_of_the_old_layout_loads(tmp_path):
    model = _model()
    peft.SoftPrompt(num_tokens=3).attach(model, rngs=nnx.Rngs(1))
    peft.save(model, tmp_path / "new.safetensors")
    tensors = load_file(tmp_path / "new.safetensors")
    assert list(tensors) == ["embeddings/prompt/vectors"]
    # What tfx wrote while the prompt was an attribute of the model.
    save_file({"prompt/vectors": tensors["embeddings/prompt/vectors"] + 1.0},
              str(tmp_path / "old.safetensors"))
    peft.load(model, tmp_path / "old.safetensors")
    np.testing.assert_array_equal(model.embeddings.prompt.vectors[...],
                                  tensors["embeddings/prompt/vectors"] + 1.0)
