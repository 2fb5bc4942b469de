"""What every PEFT method shares: the variable type of the parameters it adds, and finding the
modules it adapts."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable

from flax import nnx

from tfx.nn.paths import path_name
from tfx.peft.settings import check_targets

__all__ = ["PeftParam", "extend", "extended_class", "find_modules", "path_matcher", "retract",
           "set_module"]


class PeftParam(nnx.Param):
    """A parameter added by a PEFT method (LoRA factors, prompts, prefixes, adapters).

    A subclass of `nnx.Param`, so code that handles parameters (optimisers, shardings,
    checkpoints) handles these too; `nnx.split(model, PeftParam, ...)` separates them from the
    frozen model weights.
    """


def extend(module: nnx.Module, mixin: type) -> nnx.Module:
    """Make `module` (in place) an instance of `mixin`, a subclass of the module's kind that
    overrides one of its steps (e.g. a Block that also applies adapters); returns it. The same
    object, so its weights keep their paths and every reference to it (a stack's layers,
    layers stacked for nnx.scan) sees the change. A module of a subclass of that kind (a
    RematBlock, another extension) keeps it: the new class derives from both."""
    cls = type(module)
    if not issubclass(cls, mixin):
        module.__class__ = extended_class(mixin, cls)
    return module


def retract(module: nnx.Module, mixin: type) -> nnx.Module:
    """Undo `extend(module, mixin)` in place (the mixin's attributes are the caller's to
    delete); returns the module."""
    cls = type(module)
    if issubclass(cls, mixin):
        module.__class__ = next(base for base in cls.__bases__ if base is not mixin)
    return module


@functools.cache
def extended_class(mixin: type, cls: type) -> type:
    """The class deriving from `mixin` (a subclass of cls's kind) and `cls`, made once: mixin
    itself when cls is its direct base, so a plain module gets the plain mixin."""
    if cls in mixin.__bases__:
        return mixin
    return type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})


def find_modules(model: nnx.Module, kind: type | tuple[type, ...],
                 keep: Callable[[str, nnx.Module], bool] = lambda name, module: True,
                 ) -> list[tuple[tuple, nnx.Module]]:
    """(path, module) of every sub-module of `model` that is an instance of `kind` and passes
    `keep(path_string, module)`, in graph order."""
    return [(path, node) for path, node in nnx.iter_graph(model)
            if isinstance(node, kind) and path and keep(path_name(path), node)]


def path_matcher(targets: str | Iterable[str]) -> Callable[[str], bool]:
    """peft's `target_modules` semantics on "a/b/c" module paths: a string is a regex that must
    match the whole path; a list of names matches paths whose last part is one of them (or that
    end with "/<name>" for names holding a "/")."""
    check_targets(targets)
    if isinstance(targets, str):
        pattern = re.compile(targets)
        return lambda path: pattern.fullmatch(path) is not None
    names = tuple(targets)
    return lambda path: any(path == n or path.endswith("/" + n) for n in names)


def set_module(model: nnx.Module, path: tuple, module: nnx.Module) -> None:
    """Put `module` at `path` inside `model` (an attribute or a list item)."""
    parent = model
    for part in path[:-1]:
        parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    if isinstance(path[-1], int):
        parent[path[-1]] = module
    else:
        setattr(parent, path[-1], module)
