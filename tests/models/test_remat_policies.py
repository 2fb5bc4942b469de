"""Rematerialisation policies by name (`compute.remat_policy`, tfx.nn.remat) and the named scopes
of the layers: every policy computes the same loss and gradients as no remat, unrolled and
scanned; the tagged policies really keep their named tensors (jax's own account of the saved
residuals, `jax.ad_checkpoint.print_saved_residuals`); the scopes label the lowered program."""

from __future__ import annotations

import functools
import re
from typing import get_args

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from tfx.models import create
from tfx.models.parts import REMAT_POLICIES, ComputeConfig, RematPolicy
from tfx.nn import remat

LAYERS, BATCH, SEQ, D_MODEL = 3, 2, 8, 32
# A tiny char-gpt (LLaMA style: RoPE, RMS norms, SwiGLU, 2 KV heads) in float32.
TINY = dict(num_layers=LAYERS, d_model=D_MODEL, num_heads=4, d_ff=64, vocab_size=61)


def _model(scan: bool, **compute):
    return create("char-gpt", rngs=nnx.Rngs(0), compute=dict(scan_layers=scan, **compute),
                  **TINY)


def _loss_fn(model):
    """(params, loss(params)): next-token cross entropy of a fixed batch [BATCH, SEQ]."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, TINY["vocab_size"])

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(ids)[:, :-1]
        labels = jax.nn.one_hot(ids[:, 1:], TINY["vocab_size"])
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))

    return params, loss


@functools.cache
def _loss_and_grads(scan: bool, policy: str | None):
    """The loss and gradients of the tiny decoder, rematerialised with `policy` (None: not)."""
    compute = {} if policy is None else dict(remat=True, remat_policy=policy)
    params, loss = _loss_fn(_model(scan, **compute))
    return jax.jit(jax.value_and_grad(loss))(params)


def _saved_residuals(capsys, scan: bool, policy: str) -> list[str]:
    """jax's lines for what the backward pass of the tiny decoder's loss keeps."""
    params, loss = _loss_fn(_model(scan, remat=True, remat_policy=policy))
    capsys.readouterr()
    print_saved_residuals(loss, params)
    return capsys.readouterr().out.splitlines()


def test_the_policy_names_are_the_table_of_jax_policies():
    assert get_args(RematPolicy) == REMAT_POLICIES
    assert tuple(remat.POLICIES) == REMAT_POLICIES
    assert all(set(names) <= set(remat.CHECKPOINT_NAMES) for names in remat.SAVED_NAMES.values())
    # The default is what compute.remat=True meant before policies: jax.checkpoint's default,
    # which keeps nothing but the layer's inputs.
    assert ComputeConfig().remat_policy == "nothing_saveable"
    assert remat.POLICIES["nothing_saveable"] is jax.checkpoint_policies.nothing_saveable


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_every_policy_keeps_loss_and_gradients(policy, scan):
    loss, grads = _loss_and_grads(scan, policy)
    want_loss, want_grads = _loss_and_grads(scan, None)
    chex.assert_trees_all_close(loss, want_loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-7)


def test_a_bad_policy_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"compute\.remat_policy must be one of .*'dots_saveable'"):
        create("char-gpt", compute={"remat": True, "remat_policy": "dots"})
    with pytest.raises(ValueError, match=r"compute\.remat_policy='dots_saveable' .*compute\.remat"):
        ComputeConfig(remat_policy="dots_saveable")  # a policy without remat would do nothing
    with pytest.raises(ValueError, match=r"remat_policy must be one of .*'save_qkv_proj'"):
        remat.checkpoint_policy("save_everything")


def test_every_layer_tags_each_checkpoint_name_once():
    params, loss = _loss_fn(_model(False))  # tags are identities, there without remat too
    jaxpr = str(jax.make_jaxpr(loss)(params))
    for name in remat.CHECKPOINT_NAMES:
        assert jaxpr.count(f"name={name}") == LAYERS, name


@pytest.mark.parametrize("policy", ["nothing_saveable", *remat.SAVED_NAMES])
def test_tagged_policies_keep_their_named_tensors(capsys, policy):
    named = [re.search(r"named '(\w+)'", line) for line in _saved_residuals(capsys, False, policy)]
    kept = sorted(m.group(1) for m in named if m)
    # One of each name per layer (the decoder's attention is its self-attention only).
    assert kept == sorted(remat.SAVED_NAMES.get(policy, ()) * LAYERS)


@pytest.mark.parametrize("policy", remat.SAVED_NAMES)
def test_scanned_tagged_policies_keep_one_stacked_tensor_per_name(capsys, policy):
    """Under nnx.scan the residuals are the scan's stacked outputs [LAYERS, ...], unnamed: a
    tagged policy adds one per name to the layer inputs that "nothing_saveable" keeps."""
    def stacked(policy):
        return [line for line in _saved_residuals(capsys, True, policy)
                if line.startswith(f"f32[{LAYERS},{BATCH},{SEQ},")]

    assert len(stacked(policy)) == len(stacked("nothing_saveable")) + len(
        remat.SAVED_NAMES[policy])


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_named_scopes_label_the_compiled_program(scan):
    """The ops' names (XLA's op_name metadata, what profilers show) read layer by layer:
    "jit(loss)/jvp(layer_0)/attention/..." unrolled, ".../jvp(layers)/while/body/.../mlp/..."
    scanned, whose layers share one body."""
    params, loss = _loss_fn(_model(scan, remat=True))
    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    op_names = set(re.findall(r'op_name="([^"]*)"', hlo))
    layers = ["layers"] if scan else [f"layer_{i}" for i in range(LAYERS)]
    for layer in layers:
        for part in ("attention_norm", "attention", "mlp_norm", "mlp"):
            assert any(re.search(rf"\b{layer}\b.*/{part}/", name) for name in op_names), (
                layer, part)


def test_the_command_line_sets_the_policy():
    from tfx.cli.commands import parse

    command = parse(["train", "--workdir", "w", "--model.compute.remat", "True",
                     "--model.compute.remat-policy", "save_qkv_proj"])
    compute = command.configured().model.compute
    assert compute.remat and compute.remat_policy == "save_qkv_proj"
