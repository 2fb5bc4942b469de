"""tfx.models.functional.pure: a model as a pure function inside jax.jit / jax.grad.

The "Functional use" block of docs/models.md is run as written, and on every preset (shrunk): its
gradients are finite; in evaluation mode (rng=None) they equal `nnx.grad` of the module after
`model.eval()`; in training mode they depend on the key alone (dropout), and a model
with experts gets the gradient of its routing loss too (against `nnx.grad` of the module plus
`tfx.models.expert_losses`). Before: `nnx.split` + `nnx.merge` inside
`jax.jit(jax.value_and_grad(...))` raised TraceContextError on every preset with dropout and
on MoE models (checked below, so that the test says why the helper exists).
"""

import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import tfx.models as models
from tfx.models.expert_losses import moe_losses
from tfx.models.functional import pure

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"
MARK = "apply, params, rest = pure(model)"  # the line that identifies the guide's block
SMALL = dict(num_layers=1, d_model=32, num_heads=4, d_ff=64, vocab_size=32)
# Presets whose shape needs one more override to shrink: the experts' width.
EXTRA = {"char-moe": {"moe": {"d_ff": 32}}}
DEEPSEEK = {"moe": {"d_ff": 32, "policy": "deepseek", "jitter": 0.1}, "dropout": 0.1}


def readme_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    found = [block for block in blocks if MARK in block]
    assert len(found) == 1, f"docs/models.md needs exactly one python block with {MARK!r}"
    return found[0]


def run_readme_block(model=None, call=None) -> dict:
    """Execute the guide's block; with `model`, on that model instead of its own, and with the
    family's extra call arguments `call(ids)` (an encoder–decoder's decoder_input_ids)."""
    code = readme_block()
    if model is not None:
        code, made = re.subn(r"^model = tfx\.models\.create\(.*?\)\n", "model = MODEL\n", code,
                             flags=re.DOTALL | re.MULTILINE)
        code, called = re.subn(re.escape("apply(params, rest, ids, rng=rng)"),
                               "apply(params, rest, ids, rng=rng, **CALL(ids))", code)
        assert made == called == 1, "the guide's block no longer has the lines this test swaps"
    namespace = {"MODEL": model, "CALL": call or (lambda ids: {})}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    return namespace


def create(name: str, **overrides):
    return models.create(name, rngs=nnx.Rngs(0), **{**SMALL, **EXTRA.get(name, {}), **overrides})


def call_args(model, ids) -> dict:
    """The family's call arguments besides the ids."""
    return {"decoder_input_ids": ids} if isinstance(model, models.EncoderDecoder) else {}


def cross_entropy(logits, ids):
    """The guide block's loss without the auxiliary term."""
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def test_the_readme_block_runs_as_written():
    namespace = run_readme_block()
    assert finite(namespace["grads"]) and np.isfinite(namespace["value"])


CASES = [*models.PRESETS, "scanned-deepseek"]


def case(name: str):
    if name == "scanned-deepseek":  # stacked layers (nnx.scan) with dropout, DeepSeek routing
        return create("char-moe", **DEEPSEEK, compute={"scan_layers": True})  # and router noise
    return create(name)


@pytest.mark.parametrize("name", CASES)
def test_the_readme_pattern_on_every_preset(name):
    model = case(name)
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, SMALL["vocab_size"])
    call = call_args(model, ids)
    namespace = run_readme_block(model, lambda ids: call_args(model, ids))
    loss, params = namespace["loss"], namespace["params"]
    assert finite(namespace["grads"])
    grad = jax.jit(jax.grad(loss))

    # Evaluation mode: the eager module's gradient after model.eval().
    model.eval()
    reference = nnx.jit(nnx.grad(lambda m: cross_entropy(m(ids, **call), ids)))(model)
    chex.assert_trees_all_close(grad(params, ids, None), reference,
                                atol=1e-5, rtol=1e-5)

    # Training mode: the same key gives the same gradients; with dropout, another key others.
    one, again = grad(params, ids, jax.random.key(7)), grad(params, ids, jax.random.key(7))
    chex.assert_trees_all_equal(one, again)
    assert finite(one)
    if model.config.dropout > 0:
        other = grad(params, ids, jax.random.key(8))
        assert any(not bool(jnp.array_equal(a, b))
                   for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(other), strict=True))


def test_the_routing_loss_joins_the_gradient():
    """char-moe (no dropout, no router noise): training mode is deterministic, so the pure
    call's gradient must equal the eager module's, routing loss included."""
    model = create("char-moe")
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, SMALL["vocab_size"])
    namespace = run_readme_block(model)
    model.train()

    def eager_loss(m):
        return (cross_entropy(m(ids), ids)
                + 0.01 * moe_losses(m)["load_balancing_loss"])

    reference = nnx.jit(nnx.grad(eager_loss))(model)
    ours = jax.jit(jax.grad(namespace["loss"]))(namespace["params"], ids, jax.random.key(0))
    chex.assert_trees_all_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_aux_holds_the_losses_and_deepseek_loads_and_changes_nothing():
    model = create("char-moe", moe={"d_ff": 32, "policy": "deepseek"})
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, SMALL["vocab_size"])
    apply, params, rest = pure(model)
    before = jax.tree.map(np.asarray, (params, rest))
    _, aux = jax.jit(lambda p, r, ids, rng: apply(p, r, ids, rng=rng))(
        params, rest, ids, jax.random.key(0))
    model(ids)  # eager, in training mode: the layers record the same losses and loads
    chex.assert_trees_all_close({k: aux[k] for k in ("load_balancing_loss", "router_z_loss")},
                                moe_losses(model), atol=1e-6)
    layers = {f"stack/layers/{i}/mlp/selection_bias": layer.mlp.expert_load[...]
              for i, layer in enumerate(model.stack.layers)}
    chex.assert_trees_all_close(aux["expert_load"], layers, atol=1e-6)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, (params, rest)), before)

    _, evaluation = apply(params, rest, ids)  # rng=None: nothing recorded
    assert float(evaluation["load_balancing_loss"]) == 0.0
    assert not any(bool(jnp.any(load)) for load in evaluation["expert_load"].values())


def test_a_model_stays_in_its_mode():
    model = create("gpt2-small")
    apply, params, rest = pure(model)
    ids = jnp.ones((1, 4), jnp.int32)
    apply(params, rest, ids)  # evaluation mode on the copy only
    assert model.embeddings.dropout.deterministic is False  # created in training mode
    model.eval()
    apply(params, rest, ids, rng=jax.random.key(0))
    assert model.embeddings.dropout.deterministic is True


def test_method_and_legacy_keys():
    model = create("bert-base")
    model.eval()
    ids = jnp.ones((1, 4), jnp.int32)
    apply, params, rest = pure(model, method=lambda m, ids: m.mlm_logits(m(ids)))
    chex.assert_trees_all_close(apply(params, rest, ids)[0], model.mlm_logits(model(ids)),
                                atol=1e-6)
    chex.assert_trees_all_equal(apply(params, rest, ids, rng=jax.random.PRNGKey(3))[0],
                                apply(params, rest, ids, rng=jax.random.key(3))[0])
    with pytest.raises(TypeError, match=r"rng must be None .* or a jax.random.key"):
        apply(params, rest, ids, rng=3)


def test_before_split_and_merge_failed_under_jit_of_grad():
    """Why the helper exists: the pattern of nnx.split / nnx.merge alone."""
    model = create("gpt2-small")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.ones((1, 4), jnp.int32)

    def loss(params):
        return nnx.merge(graphdef, params, rest)(ids).mean()

    with pytest.raises(Exception, match=r"TraceContextError|different trace level"):
        jax.jit(jax.grad(loss))(params)
