"""One spelling of a parameter's path: "stack/layers/0/attention/query/kernel".

Sharding rules, fine-tuning targets and safetensors keys, checkpoint checks and expert-load
bookkeeping all name a parameter by this string, so they must all spell it the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax

__all__ = ["path_name"]


def _part(key) -> str | None:
    """One path element as its string, or None for a part that is not in the name.

    A Variable's own `.value` attribute (GetAttrKey "value", the leaf inside an nnx Variable)
    is dropped: it names no parameter. A plain "value" string (the attention value projection)
    is kept.
    """
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return None if key.name == "value" else key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    if isinstance(key, (str, int)):
        return str(key)
    raise TypeError(f"path: cannot name a path element {key!r} of type {type(key).__name__}")


def path_name(path: Iterable) -> str:
    """A parameter path -> "stack/layers/0/attention/query/kernel".

    `path` is a jax key path (DictKey / SequenceKey / GetAttrKey / FlattenedIndexKey, as from
    `jax.tree_util.tree_flatten_with_path`) or a tuple of str / int (an `nnx` flat-state key
    or an orbax flat-dict key), or a mix. Parts are joined by "/".
    """
    return "/".join(part for part in map(_part, path) if part is not None)
