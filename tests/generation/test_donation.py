"""Decoding updates the KV cache in place, step after step.

`tfx.generate` is one compiled program: the cache is created inside it and carried by a
`lax.while_loop`, so no cache buffer crosses a jit boundary and there is nothing to donate
(`donate_argnums` acts on arguments only). What donation would buy, a step that writes into the
previous step's buffer instead of a copy, is checked here on the compiled program: the loop body
copies no cache-shaped buffer. (Measured on CPU, 2 layers, batch 8, 1040 cached tokens: this
program's temporaries are 12.8 MB for an 8.5 MB cache; the same loop taking the cache as a
donated argument needs 8.8 MB of arguments + 4.3 MB of temporaries, the same peak.)

Nor does the body lay the cache out anew for attention: no copy of a layer's cache transposed.
Batch 1 and a single KV head are the cases where XLA:CPU did both (the scatter of one update
became a dynamic-update-slice that it copied per reader; Q·Kᵀ with one batch dimension read the
keys through a transposed copy).
"""

import importlib
import re

import jax.numpy as jnp
import pytest
from flax import nnx

from tfx.models import DecoderConfig, create

generate_module = importlib.import_module("tfx.generation.generate")

BATCH, PROMPT, NEW = 2, 16, 48
CONFIG = DecoderConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, d_ff=64,
                       max_len=128, position="rope")


def _compiled_hlo(config: DecoderConfig, batch: int = BATCH) -> str:
    """The optimised HLO text of tfx.generate's program for a greedy batch."""
    model = create(config, rngs=nnx.Rngs(0))
    model.eval()
    graphdef, state = nnx.split(model)
    filters = {"temperature": jnp.float32(0.0), "top_k": None, "top_p": None}
    lowered = generate_module._generate.lower(
        graphdef, state, jnp.zeros((batch, PROMPT), jnp.int32), jnp.ones((batch, PROMPT), bool),
        None, filters, jnp.asarray([-1], jnp.int32), jnp.int32(0), max_new_tokens=NEW)
    return lowered.compile().as_text()


def _loop_body_lines(hlo: str, pattern: str) -> list[str]:
    """The instructions inside any while loop's body that match the regex `pattern`."""
    computations = {block.split(" ", 1)[0].lstrip("%"): block
                    for block in re.split(r"\n(?=\S)", hlo) if block.strip()}
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo))
    return [line.strip() for name in bodies for line in computations.get(name, "").splitlines()
            if re.search(pattern, line)]


def _loop_body_copies(hlo: str, shape: str) -> list[str]:
    """Copies of a `shape` buffer (e.g. "f32[2,4,64,8]") inside any while loop's body."""
    return _loop_body_lines(hlo, re.escape(shape) + r"\{[^}]*\} copy\(")


def _cache_dims(config: DecoderConfig, batch: int = BATCH) -> tuple[int, ...]:
    return batch, config.kv_heads, PROMPT + NEW, config.d_model // config.num_heads


def _cache_shape(config: DecoderConfig, *, stacked: bool) -> str:
    dims = _cache_dims(config)
    dims = (config.num_layers, *dims) if stacked else dims
    return f"f32[{','.join(map(str, dims))}]"


def _cache_rewrites(hlo: str, dims: tuple[int, ...]) -> list[str]:
    """Loop-body instructions that copy a layer's cache [batch, kv_heads, slots, head_dim] (as
    stored, or without its size-1 axes as XLA sees it) or produce it transposed (slots last)."""
    kept = [d for d in dims[:2] if d > 1]
    shapes = {(*dims[:2], *dims[2:]): "copy", (*kept, *dims[2:]): "copy",
              (*dims[:2], *dims[:1:-1]): r"\w+", (*kept, *dims[:1:-1]): r"\w+"}
    pattern = "|".join(rf"f32\[{','.join(map(str, shape))}\]\{{[^}}]*\}} {op}\("
                       for shape, op in shapes.items())
    return _loop_body_lines(hlo, pattern)


def test_decode_loop_writes_the_cache_in_place():
    hlo = _compiled_hlo(CONFIG)
    shape = _cache_shape(CONFIG, stacked=False)
    assert shape in hlo and "while(" in hlo  # the shapes looked for are the program's
    assert _loop_body_copies(hlo, shape) == []


@pytest.mark.parametrize("batch,num_kv_heads", [(1, 4), (2, 4), (1, 1), (2, 1), (2, 2)])
def test_decode_loop_neither_copies_nor_transposes_the_cache(batch, num_kv_heads):
    config = CONFIG.replace(attention={"num_kv_heads": num_kv_heads})
    hlo = _compiled_hlo(config, batch)
    dims = _cache_dims(config, batch)
    assert f"f32[{','.join(map(str, dims))}]" in hlo  # the shapes looked for are the program's
    assert _cache_rewrites(hlo, dims) == []


@pytest.mark.xfail(strict=True, reason="tfx.models.stack scans stacked layers with the cache "
                   "as scan input and output (xs -> ys), so every step writes a whole new "
                   "stacked cache; carrying it and updating layer i in place would fix this")
def test_decode_loop_with_stacked_layers_writes_the_cache_in_place():
    config = CONFIG.replace(compute={"scan_layers": True}, num_layers=2)
    hlo = _compiled_hlo(config)
    assert _loop_body_copies(hlo, _cache_shape(config, stacked=True)) == []

