"""Decoders with mixture-of-experts layers: a one-expert MoE is the dense gated MLP, MoE layers
sit where moe_every puts them, scanned layers equal unrolled ones, the routing losses are
recorded in train mode and reach the router's gradient, cached decoding equals the full
forward, and bad MoE settings fail with the field's name."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.models import Decoder, DecoderConfig, aux_loss, moe_losses
from tfx.nn.mlp import MLP
from tfx.nn.moe import MoE

BASE = dict(vocab_size=40, d_model=16, num_layers=2, num_heads=2, d_ff=24, max_len=32,
            position="rope", norm={"kind": "rms"}, use_bias=False,
            mlp={"activation": "silu", "gated": True})


def _model(**overrides):
    return Decoder(DecoderConfig(**BASE).replace(**overrides), rngs=nnx.Rngs(0))


def _ids(batch=2, seq=10, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, 40)


def test_one_expert_moe_is_the_dense_gated_mlp():
    # E = k = 1: the router's softmax over one expert is 1, so the block is that expert's MLP.
    dense, sparse = _model(), _model(moe={"num_experts": 1, "experts_per_token": 1})
    weights = dict(nnx.to_flat_state(nnx.state(sparse, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(dense, nnx.Param)):
        if path[3:4] == ("mlp",):  # stack/layers/i/mlp/<gate|up|down>/kernel <- expert 0
            variable[...] = weights[(*path[:4], "experts", path[4])][...][0]
        else:
            variable[...] = weights[path][...]
    np.testing.assert_allclose(sparse(_ids()), dense(_ids()), rtol=1e-5, atol=1e-5)


def test_moe_every_places_the_experts():
    model = _model(num_layers=4, moe={"num_experts": 4, "every": 2})
    kinds = [type(layer.mlp) for layer in model.stack.layers]
    assert kinds == [MLP, MoE, MLP, MoE]
    assert model.stack.layers[1].mlp.experts.up.shape == (4, 16, 24)
    narrow = _model(moe={"num_experts": 4, "d_ff": 8})
    assert narrow.stack.layers[0].mlp.experts.down.shape == (4, 8, 16)


def test_scanned_layers_equal_unrolled_layers():
    unrolled = _model(moe={"num_experts": 4, "experts_per_token": 2})
    scanned = _model(moe={"num_experts": 4, "experts_per_token": 2}, compute={"scan_layers": True})
    params = nnx.state(unrolled, nnx.Param)
    layers = [params["stack"]["layers"][i] for i in range(2)]
    stacked = nnx.state(scanned, nnx.Param)
    stacked["stack"]["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    stacked["embeddings"] = params["embeddings"]
    stacked["stack"]["final_norm"] = params["stack"]["final_norm"]
    nnx.update(scanned, stacked)
    for model in (unrolled, scanned):
        model.train()
    chex.assert_trees_all_close(scanned(_ids()), unrolled(_ids()), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(moe_losses(scanned), moe_losses(unrolled), rtol=1e-5)


def test_losses_are_recorded_in_train_mode_and_reach_the_router():
    model = _model(moe={"num_experts": 4, "experts_per_token": 2})
    model.train()

    def objective(model):
        model(_ids())
        return aux_loss(model, load_balancing_weight=1.0, router_z_weight=0.5)

    loss, grads = nnx.value_and_grad(objective)(model)
    losses = moe_losses(model)
    np.testing.assert_allclose(loss, losses["load_balancing_loss"]
                               + 0.5 * losses["router_z_loss"], rtol=1e-6)
    assert 1.0 <= losses["load_balancing_loss"] <= 4.0
    assert np.abs(grads["stack"]["layers"][0]["mlp"]["router"]["kernel"][...]).sum() > 0
    # The losses are means over the layers.
    per_layer = [float(layer.mlp.load_balancing_loss[...]) for layer in model.stack.layers]
    np.testing.assert_allclose(losses["load_balancing_loss"], np.mean(per_layer), rtol=1e-6)


def test_eval_mode_records_nothing_and_is_deterministic():
    model = _model(moe={"num_experts": 4, "experts_per_token": 2, "jitter": 0.5,
                        "policy": "gshard"})
    model.eval()
    first = model(_ids())
    np.testing.assert_array_equal(model(_ids()), first)
    assert float(moe_losses(model)["router_z_loss"]) == 0.0
    # Closing over an eval-mode model in plain jax.jit works: nothing is mutated.
    np.testing.assert_allclose(jax.jit(lambda ids: model(ids))(_ids()), first, rtol=1e-5,
                               atol=1e-6)


def test_train_mode_noise_changes_with_the_stream():
    model = _model(moe={"num_experts": 4, "experts_per_token": 1, "jitter": 0.9})
    model.train()
    assert not np.allclose(model(_ids()), model(_ids()))


def test_cached_decoding_equals_the_full_forward():
    model = _model(moe={"num_experts": 4, "experts_per_token": 2})
    model.eval()
    ids = _ids(seq=8)
    full = model(ids)
    cache = model.init_cache(2, 8)
    logits, cache = model(ids[:, :5], cache=cache)
    steps = [logits]
    for t in range(5, 8):
        logits, cache = model(ids[:, t:t + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-4, atol=1e-5)
    out = tfx.generate(model, ids[:, :4], max_new_tokens=3, temperature=0.0)
    assert out.shape == (2, 7)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_padding_routes_nowhere(capacity_factor):
    # Left padding queues first: without the mask it would take capacity from real tokens and
    # count in the losses. With it, what the padding holds changes nothing at real positions.
    model = _model(moe={"num_experts": 4, "experts_per_token": 2,
                        "capacity_factor": capacity_factor})
    model.train()
    mask = jnp.ones((2, 10), bool).at[0, :4].set(False)
    ids = _ids()
    other = ids.at[0, :4].set(jnp.asarray([5, 17, 33, 2]))
    outputs = []
    for batch in (ids, other):
        logits = model(batch, attention_mask=mask)
        outputs.append((logits[mask], moe_losses(model)))
    chex.assert_trees_all_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)


def test_shared_experts_add_a_dense_mlp():
    model = _model(moe={"num_experts": 4, "experts_per_token": 2, "shared_experts": 2})
    block = model.stack.layers[0].mlp
    assert block.shared.up.kernel.shape == (16, 48)  # 2 shared experts of width d_ff = 24
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    shared = block.shared
    block.shared = None
    routed = block(x)
    block.shared = shared
    np.testing.assert_allclose(block(x), routed + shared(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, field", [
    (dict(moe={"num_experts": 0}), r"moe\.num_experts must be >= 1"),
    (dict(moe={"num_experts": 2, "experts_per_token": 3}), r"moe\.experts_per_token"),
    (dict(moe={"num_experts": 4, "capacity_factor": 0.0}), r"moe\.capacity_factor"),
    (dict(moe={"num_experts": 4, "policy": "switch"}), r"moe\.policy"),
    (dict(moe={"num_experts": 4, "experts_per_token": 1, "policy": "gshard"}),
     r"moe\.experts_per_token"),
    (dict(moe={"num_experts": 4, "jitter": 1.0}), r"moe\.jitter"),
    (dict(moe={"num_experts": 4, "dispatch": "dense"}), r"moe\.dispatch"),
    (dict(moe={"num_experts": 4, "every": 2}, compute={"scan_layers": True}), r"moe\.every=1"),
    (dict(moe={"num_experts": 4, "d_ff": 0}), r"moe\.d_ff"),
    (dict(moe={"num_experts": 4, "shared_experts": -1}), r"moe\.shared_experts"),
])
def test_bad_moe_settings(overrides, field):
    with pytest.raises(ValueError, match=field):
        DecoderConfig(**BASE).replace(**overrides)
