"""Lazy package exports (PEP 562): a package names what it exports and where each comes from,
and the defining module is imported on first use. `import tfx` and the config modules that the
command line reads then load no jax or flax. Every public submodule of such a package is an
attribute too, imported on first use (`tfx.ops.moe` after `import tfx`), as it would be after an
eager `import` of it."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """The `__getattr__` and `__dir__` of module `package`.

    Args:
      package: the package's `__name__`.
      exports: exported name -> "module" (the name is that module, e.g. a subpackage) or
        "module:attribute" (the name is an attribute of it). The package's public submodules
        need no entry.
    """

    def submodules() -> dict[str, str]:
        """Public submodule name -> its dotted name, found on disk (nothing is imported); none
        for a module that is not a package."""
        found = pkgutil.iter_modules(vars(sys.modules[package]).get("__path__", ()))
        return {m.name: f"{package}.{m.name}" for m in found if not m.name.startswith("_")}

    def __getattr__(name: str):
        where = exports.get(name) or submodules().get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = where.partition(":")
        value = importlib.import_module(module)
        if attribute:
            value = getattr(value, attribute)
        setattr(sys.modules[package], name, value)  # the next lookup skips __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports, *submodules()})

    return __getattr__, __dir__
