"""Weight-only int8 (`tfx.quant.quantize`) against a fake quantization written out here.

Reference (Qwix's symmetric absmax convention): per output column j of a kernel W [d_in, d_out],
s_j = max_i |W_ij| / 127.5 and q_ij = clip(round(W_ij / s_j), -128, 127); the float model run
with Ŵ = q·s must give the quantized model's logits (to float rounding) and its greedy tokens.
Against the float model itself the error is bounded: per layer exactly, |x·W - x·Ŵ|_j <=
||x||_1 · s_j / 2 (each weight is off by at most half a step); per model, to first order, the
logits' relative error is at most the sum of the quantized matrices' relative errors.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

qwix = pytest.importorskip("qwix")

import tfx  # noqa: E402
from tfx.models import DecoderConfig, create  # noqa: E402
from tfx.nn.linear import is_plain  # noqa: E402
from tfx.peft import LoRA, lora  # noqa: E402
from tfx.quant import Quantized, QuantizedLinear, quantize  # noqa: E402

CONFIG = DecoderConfig(vocab_size=64, d_model=64, num_heads=4, attention={"num_kv_heads": 2},
                       d_ff=128, num_layers=2, max_len=64, position="rope", norm={"kind": "rms"},
                       mlp={"activation": "silu", "gated": True}, use_bias=False,
                       embeddings={"tie": False})
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)), jnp.int32)


def fake_int8(w: jax.Array) -> jax.Array:
    """round(w / s)·s with s = max|w| / 127.5 per output column (and per stacked layer).

    In jax, not numpy: XLA divides by the constant 127.5 as a multiplication by its reciprocal,
    1 ulp from IEEE division in some columns, which moves the extreme weights' ±127.5 ties."""
    s = jnp.max(jnp.abs(w), axis=-2, keepdims=True) / 127.5
    return jnp.clip(jnp.round(w / s), -128, 127) * s


def linears(model) -> dict:
    """{path: layer} of the model's nnx.Linear layers (quantized or not)."""
    return {"/".join(map(str, p)): m for p, m in nnx.iter_graph(model)
            if isinstance(m, nnx.Linear)}


def fake_quantized(model):
    """A float copy of `model` whose linear kernels are replaced by fake_int8 of themselves."""
    model = nnx.clone(model)
    for layer in linears(model).values():
        layer.kernel[...] = fake_int8(layer.kernel[...])
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["layers", "scanned"])
def models(request):
    """(float model, its fake-quantized copy, the int8 model), unstacked or scanned layers."""
    model = create(CONFIG, compute={"scan_layers": request.param}, rngs=nnx.Rngs(0))
    return model, fake_quantized(model), quantize(nnx.clone(model), "int8")


def test_codes_and_scales_are_the_fake_quantization(models):
    model, _, quantized = models
    floats, ints = linears(model), linears(quantized)
    blocks = 1 if model.config.compute.scan_layers else CONFIG.num_layers  # 7 linears each
    assert floats.keys() == ints.keys() and len(ints) == 7 * blocks + 1  # and the head
    for path, layer in ints.items():
        assert isinstance(layer, QuantizedLinear) and layer.kernel[...].dtype == jnp.int8, path
        np.testing.assert_array_equal(layer.weight(), fake_int8(floats[path].kernel[...]))


def test_logits_equal_the_fake_quantized_float_model(models):
    _, fake, quantized = models
    np.testing.assert_allclose(quantized(IDS), fake(IDS), rtol=1e-5, atol=1e-5)


def test_logit_error_against_float_is_within_the_summed_weight_errors(models):
    model, fake, quantized = models
    weight_errors = [np.linalg.norm(layer.kernel[...] - linears(fake)[path].kernel[...])
                     / np.linalg.norm(layer.kernel[...]) for path, layer in linears(model).items()]
    exact, ours = np.asarray(model(IDS)), np.asarray(quantized(IDS))
    error = np.linalg.norm(ours - exact) / np.linalg.norm(exact)
    assert 0 < error <= sum(weight_errors), (error, sum(weight_errors))


def test_one_layer_error_is_within_half_a_step_per_weight():
    layer = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (5, 64))
    exact = np.asarray(layer(x))
    s = np.max(np.abs(layer.kernel[...]), axis=0) / 127.5
    quantized = QuantizedLinear(layer, qwix.quantize(layer.kernel[...], jnp.int8,
                                                     channelwise_axes=[1]))
    bound = np.sum(np.abs(x), axis=-1, keepdims=True) * s / 2
    assert np.all(np.abs(np.asarray(quantized(x)) - exact) <= bound * (1 + 1e-5))


def test_generate_gives_the_fake_quantized_greedy_tokens(models):
    _, fake, quantized = models
    assert quantized.output_weights() is None  # the quantized head is called, not read
    chex.assert_trees_all_equal(tfx.generate(quantized, IDS, max_new_tokens=6, temperature=0.0),
                                tfx.generate(fake, IDS, max_new_tokens=6, temperature=0.0))


def test_quantized_matrices_take_a_quarter_of_their_float_bytes(models):
    model, _, quantized = models
    float_bytes = sum(layer.kernel[...].nbytes for layer in linears(model).values())
    # int8 codes: 1 byte a weight; float32 scales: 4 bytes per output column (per layer)
    want = sum(layer.kernel[...].size + 4 * layer.kernel[...].size // layer.kernel.shape[-2]
               for layer in linears(model).values())
    got = sum(x.nbytes for x in jax.tree.leaves(nnx.state(quantized, Quantized)))
    assert got == want
    assert got / float_bytes <= 1 / 4 + 1 / CONFIG.d_model
    assert not any(isinstance(m.kernel, nnx.Param) for m in linears(quantized).values())


def test_split_merge_under_jit_keeps_the_quantized_model():
    quantized = quantize(create(CONFIG, rngs=nnx.Rngs(0)), "int8")
    graphdef, state = nnx.split(quantized)
    jitted = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, IDS)
    # Against the same model under jit, bit for bit: a jitted and an op-by-op forward round
    # differently (by ~1e-6 here), which says nothing about split and merge.
    chex.assert_trees_all_equal(jitted, nnx.jit(lambda m, ids: m(ids))(quantized, IDS))


def test_tied_head_and_embeddings_stay_float():
    model = create(CONFIG, embeddings={"tie": True}, rngs=nnx.Rngs(0))
    table = model.embeddings.tokens.table[...]
    quantize(model, "int8")
    chex.assert_trees_all_equal(model.output_weights(), table.T)
    assert model.embeddings.tokens.table[...].dtype == jnp.float32


def test_a_model_loaded_from_hugging_face(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from causal_lm_parity import hf_causal_lm, through_folder

    hf = hf_causal_lm(torch, transformers, "LlamaForCausalLM", dict(
        vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    loaded = through_folder(hf, tmp_path)
    fake, quantized = fake_quantized(loaded), quantize(loaded, "int8")
    np.testing.assert_allclose(quantized(IDS), fake(IDS), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_equal(tfx.generate(quantized, IDS, max_new_tokens=4, temperature=0.0),
                                tfx.generate(fake, IDS, max_new_tokens=4, temperature=0.0))


def test_an_encoder_decoder_t5():
    t5 = create("t5-small", dropout=0.0, num_layers=2, d_model=64, num_heads=2, d_ff=128,
                vocab_size=64, rngs=nnx.Rngs(0))
    fake, quantized = fake_quantized(t5), quantize(nnx.clone(t5), "int8")
    np.testing.assert_allclose(quantized(IDS, decoder_input_ids=IDS[:, :4]),
                               fake(IDS, decoder_input_ids=IDS[:, :4]), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_equal(tfx.generate(quantized, IDS, max_new_tokens=4, temperature=0.0),
                                tfx.generate(fake, IDS, max_new_tokens=4, temperature=0.0))


def test_int4_blocks_are_the_written_out_formula():
    """int4 in blocks of 64 along d_in: s = max|w| / 7.5 per block, q = clip(round(w/s), -8, 7)."""
    layer = nnx.Linear(128, 16, rngs=nnx.Rngs(0))
    w = layer.kernel[...].reshape(2, 64, 16)
    s = jnp.max(jnp.abs(w), axis=1, keepdims=True) / 7.5
    want = (jnp.clip(jnp.round(w / s), -8, 7) * s).reshape(128, 16)
    quantized = quantize(nnx.Sequential(layer), "int4").layers[0]
    assert quantized.kernel[...].dtype == jnp.int4 and quantized.kernel_scale.shape == (2, 16)
    np.testing.assert_array_equal(quantized.weight(), want)


def test_moe_routers_stay_float():
    model = quantize(create(CONFIG, moe={"num_experts": 4, "experts_per_token": 2, "d_ff": 64},
                            rngs=nnx.Rngs(0)), "int8")
    routers = [m for p, m in linears(model).items() if p.endswith("router")]
    assert routers and all(is_plain(m) for m in routers)
    assert np.all(np.isfinite(model(IDS)))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(qtype="int2"), "qtype must be one of"),
    (dict(qtype="nf4", block_size=48), r"block_size \(48\) must divide d_in"),
    (dict(block_size=0), "block_size must be an int >= 1"),
    (dict(targets=("nothing",)), "match no linear layer"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(create(CONFIG, rngs=nnx.Rngs(0)), **kwargs)


def test_a_model_that_is_not_a_module_is_refused():
    with pytest.raises(TypeError, match=r"model must be an nnx\.Module"):
        quantize(nnx.state(create(CONFIG, rngs=nnx.Rngs(0))), "int8")


def test_quantizing_twice_or_an_adapted_model_is_refused():
    model = quantize(create(CONFIG, rngs=nnx.Rngs(0)), "int8")
    with pytest.raises(ValueError, match=r"not a plain nnx\.Linear"):
        quantize(model, "int8")
    adapted = LoRA(rank=2).attach(create(CONFIG, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="quantize a plain model once, before attaching LoRA"):
        quantize(adapted, "int8", targets=("query",))
    moe = create(CONFIG, moe={"num_experts": 4, "experts_per_token": 2, "d_ff": 64})
    with pytest.raises(ValueError, match="MoE router"):
        quantize(moe, "int8", targets=("router",))


def test_lora_merge_into_a_quantized_weight_is_refused():
    model = LoRA(rank=2).attach(quantize(create(CONFIG, rngs=nnx.Rngs(0)), "int8"),
                                rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="cannot merge LoRA factors"):
        lora.merge(nnx.state(model), lora.weights_of(model))
