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
keys through a transposed copy). The paged engine's step, whose cache is donated, likewise
copies no page pool at batch 1 (`tfx.ops._scatter`).
"""

import functools
import importlib
import re

import jax.numpy as jnp
import pytest
from compiled import compile_as_users_do
from flax import nnx

from tfx.generation._paged_step import RowSettings, compile_step
from tfx.models import DecoderConfig, create
from tfx.ops.paged import init_paged_cache

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
    return compile_as_users_do(lowered).as_text()


def _loop_body_lines(hlo: str, pattern: str) -> list[str]:
    """The instructions inside any while loop's body that match the regex `pattern`."""
    computations = {block.split(" ", 1)[0].lstrip("%"): block
                    for block in re.split(r"\n(?=\S)", hlo) if block.strip()}
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo))
    return [line.strip() for name in bodies for line in computations.get(name, "").splitlines()
            if re.search(pattern, line)]


def _made_by(shape: str, op: str = "copy") -> str:
    """A regex for an instruction `op` (a regex too) whose result is a `shape` buffer (e.g.
    "f32[2,4,64,8]"), in any layout."""
    return re.escape(shape) + rf"\{{[^}}]*\}} {op}\("


def _loop_body_copies(hlo: str, shape: str) -> list[str]:
    """Copies of a `shape` buffer inside any while loop's body."""
    return _loop_body_lines(hlo, _made_by(shape))


def _cache_dims(config: DecoderConfig, batch: int = BATCH) -> tuple[int, ...]:
    return batch, config.kv_heads, PROMPT + NEW, config.d_model // config.num_heads


def _shape(dims: tuple[int, ...]) -> str:
    """HLO's name of a float32 array shape, e.g. "f32[2,4,64,8]"."""
    return f"f32[{','.join(map(str, dims))}]"


def _cache_rewrites(hlo: str, dims: tuple[int, ...]) -> list[str]:
    """Loop-body instructions that copy a layer's cache [batch, kv_heads, slots, head_dim] (as
    stored, or without its size-1 axes as XLA sees it) or produce it transposed (slots last)."""
    batch, heads, slots, head_dim = dims
    kept = [d for d in (batch, heads) if d > 1]
    shapes = {(batch, heads, slots, head_dim): "copy", (*kept, slots, head_dim): "copy",
              (batch, heads, head_dim, slots): r"\w+", (*kept, head_dim, slots): r"\w+"}
    return _loop_body_lines(hlo, "|".join(_made_by(_shape(shape), op)
                                          for shape, op in shapes.items()))


@pytest.mark.parametrize("batch,num_kv_heads", [(1, 4), (2, 4), (1, 1), (2, 1), (2, 2)])
def test_decode_loop_writes_the_cache_in_place(batch, num_kv_heads):
    """No copy of a layer's cache in the loop body, and none transposed for attention."""
    config = CONFIG.replace(attention={"num_kv_heads": num_kv_heads})
    hlo = _compiled_hlo(config, batch)
    dims = _cache_dims(config, batch)
    # the shapes looked for are the program's
    assert _shape(dims) in hlo and "while(" in hlo
    assert _cache_rewrites(hlo, dims) == []


@pytest.mark.parametrize("batch", [1, 2])
def test_paged_step_writes_the_pools_in_place(batch):
    """The paged engine's step (its cache donated) copies no page pool, flat or paged."""
    model = create(CONFIG, rngs=nnx.Rngs(0))
    model.eval()
    graphdef, state = nnx.split(model)
    heads, head_dim, pages, page_size = CONFIG.kv_heads, CONFIG.d_model // CONFIG.num_heads, 16, 8
    cache = init_paged_cache(num_layers=1, num_pages=pages, page_size=page_size, batch=batch,
                             pages_per_seq=8, num_kv_heads=heads, head_dim=head_dim)
    zeros = functools.partial(jnp.zeros, (batch,))
    rows = RowSettings(temperature=zeros(jnp.float32), top_k=zeros(jnp.int32),
                       top_p=zeros(jnp.float32), keys=jnp.zeros((batch, 2), jnp.uint32),
                       counts=zeros(jnp.int32), variants=zeros(jnp.int32))
    hlo = compile_as_users_do(compile_step(graphdef).lower(
        state, cache, jnp.zeros((batch, 1), jnp.int32), jnp.ones((batch, 1), bool),
        rows)).as_text()
    shapes = [_shape((heads, pages, page_size, head_dim)), _shape((heads, pages * page_size,
                                                                   head_dim))]
    assert shapes[0] in hlo  # the shapes looked for are the program's
    copies = re.findall("|".join(map(_made_by, shapes)), hlo)
    assert copies == []


@pytest.mark.xfail(strict=True, reason="tfx.models.stack scans stacked layers with the cache "
                   "as scan input and output (xs -> ys), so every step writes a whole new "
                   "stacked cache; carrying it and updating layer i in place would fix this")
def test_decode_loop_with_stacked_layers_writes_the_cache_in_place():
    config = CONFIG.replace(compute={"scan_layers": True}, num_layers=2)
    hlo = _compiled_hlo(config)
    assert _loop_body_copies(hlo, _shape((config.num_layers, *_cache_dims(config)))) == []

