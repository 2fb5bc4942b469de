"""Several LoRA adapters in one batch: each row's logits equal those of the model with that row's
adapter alone attached by `tfx.peft.lora.attach` (row variant 0: the plain model), whole
sequences and a KV-cache decoding step, layers stacked (nnx.scan, remat) or not, under jit."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.models import DecoderConfig, create
from tfx.peft import attach_many, lora
from tfx.peft.multi_lora import MultiLoRALinear

# A LLaMA-style decoder with GQA (4 query heads, 2 KV heads) and an untied head.
GQA = DecoderConfig(vocab_size=64, d_model=32, num_heads=4, attention={"num_kv_heads": 2}, d_ff=48,
                    num_layers=2, max_len=64, position="rope", norm={"kind": "rms"},
                    mlp={"activation": "silu", "gated": True}, use_bias=False,
                    embeddings={"tie": False})
ROWS = jnp.asarray([3, 1, 2, 0, 1], jnp.int32)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (len(ROWS), 7)), jnp.int32)
# Three adapters of different ranks, scales (one rsLoRA) and targets, overlapping on "value".
ADAPTERS = {"qv": dict(rank=2, alpha=4.0, targets=("query", "value")),
            "mlp": dict(rank=4, alpha=2.0, targets=("value", "down", "gate")),
            "head": dict(rank=3, alpha=6.0, targets=("out", "head"), rslora=True)}


def _adapter(model, seed: int, **settings) -> lora.LoRAWeights:
    """Factors with random a and b (init leaves b zero, which would hide a misplaced b)."""
    weights = lora.init(jax.random.key(seed), nnx.state(model, nnx.Param),
                        init_style="seed_normal", **settings)
    rng = np.random.default_rng(seed)
    factors = {path: lora.Factors(f.a, jnp.asarray(0.2 * rng.normal(size=f.b.shape), f.b.dtype))
               for path, f in weights.factors.items()}
    return lora.LoRAWeights(factors, weights.scale)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, rows):
    """Logits of whole sequences [batch, seq, vocab], and of the last token [batch, 1, vocab]
    decoded with a KV cache after the others, the row variants chosen inside jit."""
    model = nnx.merge(graphdef, state)
    with tfx.nn.row_variants(rows):
        whole = model(ids)
        _, cache = model(ids[:, :-1], cache=model.init_cache(ids.shape[0], ids.shape[1]))
        step, _ = model(ids[:, -1:], cache=cache)
    return whole, step


def _run(model, rows=ROWS):
    return _forward(*nnx.split(model), IDS, rows)


@pytest.mark.parametrize("compute", [{"scan_layers": False}, {"scan_layers": True},
                                     {"scan_layers": True, "remat": True}])
def test_each_row_computes_its_adapter_alone(compute):
    model = create(GQA.replace(compute=compute), rngs=nnx.Rngs(0))
    adapters = {name: _adapter(model, seed, **settings)
                for seed, (name, settings) in enumerate(ADAPTERS.items(), 1)}
    alone = [_run(model)]
    for weights in adapters.values():
        alone.append(_run(lora.attach(nnx.clone(model), weights)))
    names = attach_many(model, adapters)
    assert names == tuple(ADAPTERS)
    assert isinstance(model.stack.layers[0].attention.value if not compute["scan_layers"]
                      else model.stack.layers.attention.value, MultiLoRALinear)
    mixed = _run(model)
    for row, variant in enumerate(np.asarray(ROWS)):
        expected = jax.tree.map(lambda x, r=row: x[r], alone[variant])
        chex.assert_trees_all_close(jax.tree.map(lambda x, r=row: x[r], mixed), expected,
                                    atol=1e-5, rtol=1e-5)
    for variant in range(1, len(alone)):  # every adapter changes the output
        assert np.abs(alone[variant][0] - alone[0][0]).max() > 1e-3


def test_smaller_ranks_and_untargeted_layers_are_exact_zeros():
    model = create(GQA, rngs=nnx.Rngs(0))
    small = _adapter(model, 1, rank=2, alpha=2.0, targets=("value",))
    attach_many(model, {"small": small,
                        "big": _adapter(model, 2, rank=5, alpha=5.0, targets=("value", "query"))})
    value, query = model.stack.layers[1].attention.value, model.stack.layers[1].attention.query
    assert value.lora_a.shape == (3, 32, 5) and value.lora_b.shape == (3, 5, 16)
    factors = small.factors["stack/layers/1/attention/value"]
    chex.assert_trees_all_equal(value.lora_a[1, :, :2], factors.a)
    chex.assert_trees_all_close(value.lora_b[1, :2], small.scale * factors.b, rtol=1e-6)
    for zeros in (value.lora_a[0], value.lora_b[0], value.lora_a[1, :, 2:], value.lora_b[1, 2:],
                  query.lora_a[1], query.lora_b[1]):
        assert not np.any(np.asarray(zeros))


def test_stacked_factors_keep_the_layer_axis_first():
    model = create(GQA.replace(compute={"scan_layers": True}), rngs=nnx.Rngs(0))
    attach_many(model, {"a": _adapter(model, 1, rank=2, alpha=2.0, targets=("down",))})
    down = model.stack.layers.mlp.down
    assert down.lora_a.shape == (2, 2, 48, 2) and down.lora_b.shape == (2, 2, 2, 32)


def test_row_variants_context_is_scoped():
    assert tfx.nn.current_row_variants() is None
    with tfx.nn.row_variants([1, 0]) as rows:
        chex.assert_trees_all_equal(tfx.nn.current_row_variants(), rows)
        with tfx.nn.row_variants(np.asarray([2, 2], np.int64)):
            assert tfx.nn.current_row_variants().dtype == jnp.int32
        chex.assert_trees_all_equal(tfx.nn.current_row_variants(), rows)
    assert tfx.nn.current_row_variants() is None


@pytest.mark.parametrize("rows, message", [([[0, 1]], "int array \\[batch\\]"),
                                           ([0.5, 1.0], "int array \\[batch\\]")])
def test_row_variants_refuses_rows_that_are_not_one_int_per_row(rows, message):
    with pytest.raises(ValueError, match=message), tfx.nn.row_variants(rows):
        pass


@pytest.mark.parametrize("scan_layers", [False, True])
def test_eager_calls_without_context_or_with_wrong_rows_are_refused(scan_layers):
    model = create(GQA.replace(compute={"scan_layers": scan_layers}), rngs=nnx.Rngs(0))
    attach_many(model, {"a": _adapter(model, 1, rank=2, alpha=2.0, targets=("query",))})
    with pytest.raises(ValueError, match=r"inside `with tfx\.nn\.row_variants"):
        model(IDS)
    with pytest.raises(ValueError, match="one variant per batch row"), \
            tfx.nn.row_variants([0, 1]):
        model(IDS)
    with pytest.raises(ValueError, match=r"must be in \[0, 2\)"), \
            tfx.nn.row_variants([0, 1, 2, 0, 1]):
        model(IDS)
    with tfx.nn.row_variants([0, 1, 1, 0, 1]):
        assert model(IDS).shape == (*IDS.shape, 64)


def test_attach_many_refuses_bad_adapters():
    model = create(GQA, rngs=nnx.Rngs(0))
    good = _adapter(model, 1, rank=2, alpha=2.0, targets=("query",))
    with pytest.raises(TypeError, match="non-empty mapping"):
        attach_many(model, {})
    with pytest.raises(TypeError, match=r"must be tfx\.peft\.lora\.LoRAWeights"):
        attach_many(model, {"a": good.factors})
    tokens = _adapter(model, 2, rank=2, alpha=2.0, targets=("tokens",))
    with pytest.raises(ValueError, match="token embedding embeddings/tokens"):
        attach_many(model, {"a": good, "t": tokens})
    elsewhere = lora.LoRAWeights({"stack/layers/7/attention/query": good.factors[
        "stack/layers/0/attention/query"]}, 1.0)
    with pytest.raises(ValueError, match="'stack/layers/7/attention/query', which is no linear"):
        attach_many(model, {"x": elsewhere})
    wider = create(GQA.replace(d_model=48), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"adapter 'w': factors of .* have shapes"):
        attach_many(model, {"w": _adapter(wider, 3, rank=2, alpha=2.0, targets=("query",))})
    lora.attach(model, good)
    with pytest.raises(ValueError, match="already has LoRA layers"):
        attach_many(model, {"a": good})
