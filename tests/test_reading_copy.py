"""docs/llama_in_one_file.py, the one-file reading copy of a LLaMA forward pass, gives the logits
of tfx's own decoders: same weights (mapped from the model's `nnx.state` by their tfx paths),
same tokens, same numbers, in float32.

The reading copy imports neither tfx nor flax; the mapping from a tfx model (`from_tfx`) lives
here so that it stays so.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import tfx
from tfx.nn.paths import path_name

_PATH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "llama_in_one_file.py"
_SPEC = importlib.util.spec_from_file_location("llama_in_one_file", _PATH)
reading = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = reading  # dataclasses looks the module up while it runs
_SPEC.loader.exec_module(reading)

CASES = {
    # Tied embeddings, 4 query heads sharing 2 key/value heads, eps 1e-6.
    "char-gpt": ("char-gpt", dict(num_layers=2)),
    # Its own head, 8 query heads over 2 key/value heads, eps 1e-5, LLaMA 3's rope_theta.
    "llama-tiny": ("llama-tiny", dict(num_layers=2, vocab_size=300, rope={"theta": 500000.0})),
    # Layers stacked on a leading axis and scanned: from_tfx unstacks them.
    "char-gpt-scanned": ("char-gpt", dict(num_layers=2, compute={"scan_layers": True})),
}


def from_tfx(model) -> dict:
    """A tfx decoder's parameters as the reading copy's flat dict: path name -> array, with
    scanned layers' stacked arrays split into one entry per layer."""
    scanned = model.config.compute.scan_layers
    weights = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, value = path_name(path), variable[...]
        if scanned and name.startswith("stack/layers/"):
            for i, layer_value in enumerate(value):
                weights[name.replace("stack/layers/", f"stack/layers/{i}/", 1)] = layer_value
        else:
            weights[name] = value
    return weights


def reading_config(config) -> reading.Config:
    """The reading copy's Config for a tfx DecoderConfig."""
    return reading.Config(
        num_layers=config.num_layers, num_heads=config.num_heads,
        num_kv_heads=config.attention.num_kv_heads or config.num_heads,
        rope_theta=config.rope.theta, norm_eps=config.norm.eps)


def _model(case: str):
    """The case's model with random weights, every parameter scaled by its own noise: norm
    scales start at one, where a norm applied twice or to the wrong branch goes unseen."""
    preset, overrides = CASES[case]
    model = tfx.models.create(preset, rngs=nnx.Rngs(0), **overrides)
    leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [
        x * (1 + 0.2 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys, strict=True)]))
    return model


def _tokens(model) -> jax.Array:
    return jax.random.randint(jax.random.key(2), (2, 12), 0, model.config.vocab_size)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reading_copy_gives_tfx_logits(case):
    model = _model(case)
    tokens = _tokens(model)
    expected = model(tokens)
    actual = reading.forward(from_tfx(model), tokens, reading_config(model.config))
    assert actual.shape == (2, 12, model.config.vocab_size) and actual.dtype == jnp.float32
    chex.assert_trees_all_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_the_comparison_sees_rotary_positions(monkeypatch):
    """Without rope the reading copy is a different model: the check above can fail."""
    model = _model("char-gpt")
    tokens = _tokens(model)
    monkeypatch.setattr(reading, "apply_rope", lambda x, positions, theta: x)
    actual = reading.forward(from_tfx(model), tokens, reading_config(model.config))
    # The first token attends only to itself, where a rotation changes nothing.
    chex.assert_trees_all_close(actual[:, 0], model(tokens)[:, 0], atol=1e-5, rtol=1e-5)
    assert jnp.max(jnp.abs(actual[:, 1:] - model(tokens)[:, 1:])) > 1e-3


def test_reading_copy_imports_only_jax():
    tree = ast.parse(_PATH.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "jax"}, imported
