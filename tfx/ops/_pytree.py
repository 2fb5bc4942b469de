"""Fields of the dataclasses tfx registers as pytrees (`jax.tree_util.register_dataclass`)."""

from __future__ import annotations

import dataclasses
from typing import Any


def static_field(default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is part of the pytree's structure (static under jit and remat),
    not an array: `register_dataclass` reads `metadata["static"]`."""
    return dataclasses.field(default=default, metadata={"static": True})
