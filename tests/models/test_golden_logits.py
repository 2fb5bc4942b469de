"""Logits of every preset (shrunk to test size, same architecture) and of every attention,
position, cache and fine-tuning path, stored before the core redesign (issue 18) at revision
b3c9331, must stay equal within 1e-6 relative.

Each case's parameters are stored with its logits (`golden/<case>.safetensors`), so the check
does not depend on the order in which modules draw their initial values: only on the maths.
A parameter that moves to another path is renamed in `RENAMED`, never regenerated.

Regenerate only for a new case: `python tests/models/test_golden_logits.py CASE`.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tfx import peft
from tfx.models import PRESETS, create

GOLDEN = pathlib.Path(__file__).parent / "golden"
SMALL = dict(vocab_size=97, d_model=32, num_heads=4, d_ff=48, num_layers=2, dropout=0.0)
# Parameter path now -> the path it was stored at, for parameters the redesign moved:
# Transformer-XL's W_R, u and v went from the attention into its positional part, and a soft
# prompt from the model into its embeddings.
RENAMED = {f"stack/layers/{i}/attention/position/{name}": f"stack/layers/{i}/attention/{name}"
           for i in range(2)
           for name in ("position_proj/kernel", "content_bias", "position_bias")}
RENAMED["embeddings/prompt/vectors"] = "prompt/vectors"
BATCH, SEQ = 2, 7


def _ids(seed: int, shape=(BATCH, SEQ)) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, SMALL["vocab_size"])


def _padding() -> jax.Array:
    return jnp.arange(SEQ)[None] < jnp.array([[SEQ], [SEQ - 2]])  # second row right-padded


def _preset(name: str, **changes):
    config = PRESETS[name]
    if config.attention.num_kv_heads:
        changes["attention"] = {"num_kv_heads": 2, **changes.get("attention", {})}
    if config.moe is not None:
        changes["moe"] = {"d_ff": 24, **changes.get("moe", {})}
    return create(config.replace(**SMALL, **changes), rngs=nnx.Rngs(0))


def _decode(model) -> jax.Array:
    """Prefill 5 tokens of padded prompts, then 2 steps, through the KV cache."""
    ids = _ids(1)
    cache = model.init_cache(BATCH, 16)
    first, cache = model(ids[:, :5], attention_mask=_padding()[:, :5], cache=cache)
    steps = []
    for t in (5, 6):
        out, cache = model(ids[:, t:t + 1], cache=cache)
        steps.append(out)
    return jnp.concatenate([first, *steps], axis=1)


def _decoder_logits(model) -> jax.Array:
    return model(_ids(1), attention_mask=_padding())


def _encoder_hidden(model) -> jax.Array:
    types = (jnp.arange(SEQ) >= 3).astype(jnp.int32)[None].repeat(BATCH, 0)
    return model(_ids(1), attention_mask=_padding(), token_type_ids=types)


def _seq2seq_logits(model) -> jax.Array:
    return model(_ids(1), decoder_input_ids=_ids(2, (BATCH, 5)), attention_mask=_padding())


def _seq2seq_decode(model) -> jax.Array:
    encoded = model.encode(_ids(1), attention_mask=_padding())
    cache = model.init_cache(encoded, 8, attention_mask=_padding())
    targets, outs = _ids(2, (BATCH, 3)), []
    for t in range(3):
        out, cache = model.decode(targets[:, t:t + 1], cache=cache)
        outs.append(out)
    return jnp.concatenate(outs, axis=1)


def _xl_segments(model) -> jax.Array:
    memory = model.init_cache(BATCH, 6)
    first, memory = model(_ids(1), cache=memory)
    second, _ = model(_ids(2), cache=memory)
    return jnp.concatenate([first, second], axis=1)


CASES = {
    # Every preset, shrunk.
    "bert-base": (lambda: _preset("bert-base"), _encoder_hidden),
    "minilm-l6": (lambda: _preset("minilm-l6"), _encoder_hidden),
    "gpt2-small": (lambda: _preset("gpt2-small"), _decoder_logits),
    "llama-tiny": (lambda: _preset("llama-tiny"), _decoder_logits),
    "char-gpt": (lambda: _preset("char-gpt"), _decoder_logits),
    "char-moe": (lambda: _preset("char-moe"), _decoder_logits),
    "t5-small": (lambda: _preset("t5-small"), _seq2seq_logits),
    "transformer-base": (lambda: _preset("transformer-base"), _seq2seq_logits),
    # Positions, masks and kernels.
    "alibi": (lambda: _preset("gpt2-small", position="alibi"), _decoder_logits),
    "sinusoidal-decoder": (lambda: _preset("gpt2-small", position="sinusoidal"),
                           _decoder_logits),
    "nope": (lambda: _preset("char-gpt", position="none"), _decoder_logits),
    "rope-interleaved-partial": (
        lambda: _preset("char-gpt", rope={"layout": "interleaved", "fraction": 0.5}),
        _decoder_logits),
    "sliding-window": (lambda: _preset("llama-tiny", attention={"sliding_window": 3}),
                       _decoder_logits),
    "attention-pattern": (lambda: _preset("char-gpt", attention={"pattern": "window:2|global:1"}),
                          _decoder_logits),
    "blocked-kernel": (lambda: _preset("char-gpt", attention={"implementation": "blocked"}),
                       _decoder_logits),
    "scan-layers": (lambda: _preset("llama-tiny", compute={"scan_layers": True}),
                    _decoder_logits),
    "moe-deepseek": (lambda: _preset("char-moe", moe={"policy": "deepseek", "shared_experts": 1}),
                     _decoder_logits),
    # Caches.
    "kv-cache": (lambda: _preset("llama-tiny"), _decode),
    "kv-cache-scan": (lambda: _preset("char-gpt", compute={"scan_layers": True}), _decode),
    "ring-cache": (lambda: _preset("llama-tiny", attention={"sliding_window": 3}), _decode),
    "alibi-cache": (lambda: _preset("gpt2-small", position="alibi"), _decode),
    "xl-memory": (lambda: _preset("char-gpt", position="xl"), _xl_segments),
    "t5-cache": (lambda: _preset("t5-small"), _seq2seq_decode),
    # Fine-tuning.
    "lora": (lambda: _preset("char-gpt"),
             peft.LoRA(rank=2, targets=("query", "value", "out")), _decoder_logits),
    "prefix": (lambda: _preset("llama-tiny"), peft.Prefix(num_tokens=3), _decoder_logits),
    "prefix-cache": (lambda: _preset("llama-tiny"), peft.Prefix(num_tokens=3), _decode),
    "prefix-t5": (lambda: _preset("t5-small"),
                  peft.Prefix(num_tokens=2, targets=("attention", "cross_attention")),
                  _seq2seq_logits),
    "soft-prompt": (lambda: _preset("gpt2-small"),
                    peft.SoftPrompt(num_tokens=3), _decoder_logits),
    "soft-prompt-cache": (lambda: _preset("char-gpt"),
                          peft.SoftPrompt(num_tokens=3), _decode),
    "soft-prompt-bert": (lambda: _preset("bert-base"),
                         peft.SoftPrompt(num_tokens=2), _encoder_hidden),
    "adapters": (lambda: _preset("char-gpt"), peft.Adapters(size=4), _decoder_logits),
    "adapters-t5": (lambda: _preset("t5-small"),
                    peft.Adapters(size=4, cross_attention=True), _seq2seq_logits),
}


def _flat(model) -> dict[str, nnx.Variable]:
    return {"/".join(map(str, path)): variable
            for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _run(name: str, params: dict[str, np.ndarray] | None) -> tuple[dict, np.ndarray]:
    """Build case `name` (and attach its fine-tuning method), set its parameters (None:
    perturb its own, so that zero-initialised factors do something) and run it.
    Returns (the parameters by path, the output)."""
    build, *method, run = CASES[name]  # (build, run) or (build, fine-tuning method, run)
    model = build()
    for m in method:
        m.attach(model, rngs=nnx.Rngs(1))
    used = {}
    for index, (path, variable) in enumerate(sorted(_flat(model).items())):
        if params is None:
            noise = np.random.default_rng(index).standard_normal(variable.shape)
            value = np.asarray(variable[...]) + 0.05 * noise.astype(np.float32)
        else:
            value = params[RENAMED.get(path, path)]
        variable[...] = jnp.asarray(value, variable.dtype)
        used[RENAMED.get(path, path)] = np.asarray(variable[...])
    return used, np.asarray(run(model))


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_equal_those_stored_before_the_redesign(name):
    stored = load_file(GOLDEN / f"{name}.safetensors")
    expected = stored.pop("__output__")
    used, got = _run(name, stored)
    unmatched = sorted(set(used) ^ set(stored))
    assert not unmatched, f"parameters not matched between the model and the file: {unmatched}"
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())


def _generate(names: list[str]) -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name in names:
        params, out = _run(name, None)
        save_file({**params, "__output__": out}, str(GOLDEN / f"{name}.safetensors"))
        print(f"{name}: {out.shape}, {len(params)} parameters")


if __name__ == "__main__":
    _generate(sys.argv[1:] or sorted(CASES))
