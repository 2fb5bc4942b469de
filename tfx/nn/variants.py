"""Which of a layer's stacked weight variants each batch row uses (0 = the base weights).

A layer that holds several variants of its weights side by side (stacked on one axis, index 0
the base) reads the choice of the current call here, so the model's signature stays the same
and the layers between the caller and that layer need not pass it along:

    @jax.jit
    def step(graphdef, state, ids, rows):            # rows: int32 [batch]
        model = nnx.merge(graphdef, state)
        with tfx.nn.row_variants(rows):
            return model(ids)

The choice is a `contextvars.ContextVar`, read while the model is traced: set it inside the
jitted function, from one of its arguments (a tracer), as above. Layers scanned with
`nnx.scan` or rematerialised with `nnx.remat` are traced inside the `with` block too and close
over the same array. A context set around a call to an already jitted function is not part of
that function's cache key: its rows would be baked into the first compilation.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

__all__ = ["current_row_variants", "row_variants"]

_ROWS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("row_variants",
                                                                        default=None)


@contextlib.contextmanager
def row_variants(rows) -> Iterator[jax.Array]:
    """Within the block, batch row i of a call uses variant rows[i] of the layers that hold
    several (0 = the base weights).

    Args:
      rows: int [batch] (a jax or numpy array, a list, or a tracer inside jit).
    Yields:
      rows as a jax int32 array [batch].
    Raises:
      ValueError: rows is not one-dimensional or not of an integer dtype.
    """
    rows = jnp.asarray(rows)
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"rows must be an int array [batch], got {rows.dtype} of shape "
                         f"{rows.shape}")
    rows = rows.astype(jnp.int32)
    token = _ROWS.set(rows)
    try:
        yield rows
    finally:
        _ROWS.reset(token)


def current_row_variants() -> jax.Array | None:
    """The int32 [batch] rows of the innermost active `row_variants`, or None outside one."""
    return _ROWS.get()
