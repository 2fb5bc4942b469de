"""QLoRA: an NF4 base (`tfx.quant.quantize(model, "nf4")`) under tfx.peft's LoRA.

NF4 against the published code table (Dettmers et al. 2023, QLoRA, Appendix E) written out
here: per block of 64 weights along d_in (per output column), absmax scale, each weight the
nearest of the 16 values. Then the fine-tuning path: only the factors get gradients
(`tfx.peft.only_peft`), the base stays as it was, the loss falls, and PEFT-only files
(`tfx.peft.save` / `load`) rebuild the trained model on a freshly quantized base.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

pytest.importorskip("qwix")

import tfx
from tfx.models import DecoderConfig, create
from tfx.peft import LoRA, PeftParam
from tfx.quant import Quantized, QuantizedLinear, quantize

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)
CONFIG = DecoderConfig(vocab_size=64, d_model=64, num_heads=4, attention={"num_kv_heads": 2},
                       d_ff=128, num_layers=2, max_len=64, position="rope", norm={"kind": "rms"},
                       mlp={"activation": "silu", "gated": True}, use_bias=False,
                       embeddings={"tie": False})
METHOD = LoRA(rank=4, targets=("query", "value", "up", "down"), init_style="seed")
# A tiny task: continue one fixed sequence (teacher forcing).
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)


def nf4_reference(w: np.ndarray, block: int = 64) -> np.ndarray:
    """Dequantized NF4 of w [d_in, d_out]: blocks of `block` rows per column, scaled by the
    block's max|w|, each weight the nearest table value."""
    d_in, d_out = w.shape
    blocks = w.reshape(d_in // block, block, d_out)
    absmax = np.max(np.abs(blocks), axis=1, keepdims=True)
    codes = np.argmin(np.abs(blocks[..., None] / absmax[..., None] - NF4), axis=-1)
    return (NF4[codes] * absmax).reshape(d_in, d_out)


def test_nf4_is_the_published_table_per_block_of_64():
    layer = nnx.Linear(128, 16, rngs=nnx.Rngs(0))
    w = np.asarray(layer.kernel[...])
    model = quantize(nnx.Sequential(layer), "nf4")
    quantized = model.layers[0]
    assert isinstance(quantized, QuantizedLinear) and quantized.kernel_scale.shape == (2, 16)
    np.testing.assert_allclose(quantized.weight(), nf4_reference(w), rtol=1e-6, atol=1e-7)


def qlora_model(seed: int = 1):
    """The NF4 base with freshly initialised factors (b random so that a gets gradients)."""
    model = METHOD.attach(quantize(create(CONFIG, rngs=nnx.Rngs(0)), "nf4"), rngs=nnx.Rngs(seed))
    for _, variable in nnx.to_flat_state(nnx.state(model, PeftParam)):
        variable[...] = 0.05 * jax.random.normal(jax.random.key(seed), variable.shape)
    return model


def loss_fn(graphdef, params, rest):
    logits = nnx.merge(graphdef, params, rest)(TOKENS[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()


def train(model, steps: int):
    """`steps` Adam steps on the PEFT parameters (tfx.peft.only_peft over the Param state);
    returns the model, the frozen state before and after, and the losses."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = tfx.peft.only_peft(optax.adam(3e-2), params)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(graphdef, params, rest)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    before, losses = params, []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return nnx.merge(graphdef, params, rest), before, params, losses


def test_factors_get_gradients_and_the_base_stays():
    model = qlora_model()
    layer = model.stack.layers[0].attention.query
    assert isinstance(layer, QuantizedLinear) and layer.lora_a.dtype == jnp.float32
    base = nnx.state(model, Quantized)
    trained, before, after, _ = train(model, 3)
    for (path, old), (_, new) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after),
                                     strict=True):
        changed = not np.array_equal(old[...], new[...])
        assert changed == isinstance(old, PeftParam), path
    jax.tree.map(np.testing.assert_array_equal, nnx.state(trained, Quantized), base)


def test_loss_decreases_and_peft_files_rebuild_the_trained_model(tmp_path):
    trained, *_, losses = train(qlora_model(), 25)
    assert losses[-1] < 0.7 * losses[0], losses
    path = tmp_path / "qlora.safetensors"
    tfx.peft.save(trained, path, method=METHOD)
    names = set(load_file(path))
    assert names == {"/".join(map(str, p)) for p, _ in
                     nnx.to_flat_state(nnx.state(trained, PeftParam))}
    assert all(name.rsplit("/", 1)[-1] in ("lora_a", "lora_b") for name in names)
    fresh = tfx.peft.load(quantize(create(CONFIG, rngs=nnx.Rngs(0)), "nf4"), path)
    np.testing.assert_array_equal(fresh(TOKENS), trained(TOKENS))
    tokens = tfx.generate(fresh, TOKENS[:, :4], max_new_tokens=4, temperature=0.0)
    np.testing.assert_array_equal(tokens, tfx.generate(trained, TOKENS[:, :4],
                                                       max_new_tokens=4, temperature=0.0))


def test_detach_gives_back_the_quantized_base():
    base = quantize(create(CONFIG, rngs=nnx.Rngs(0)), "nf4")
    model = qlora_model()
    weights = tfx.peft.lora.detach(model)
    assert set(weights.factors) == {p for p, m in _linears(model).items()
                                    if p.rsplit("/", 1)[-1] in METHOD.targets}
    assert all(type(m) is QuantizedLinear for m in _linears(model).values())
    np.testing.assert_array_equal(model(TOKENS), base(TOKENS))


def _linears(model) -> dict:
    return {"/".join(map(str, p)): m for p, m in nnx.iter_graph(model)
            if isinstance(m, nnx.Linear)}
