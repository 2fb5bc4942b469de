"""Lazy package exports (PEP 562): a package names what it exports and where each comes from,
and the defining module is imported on first use. `import tfx` and the config modules that the
command line reads then load no jax or flax."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """The `__getattr__` and `__dir__` of module `package`.

    Args:
      package: the package's `__name__`.
      exports: exported name -> "module" (the name is that module, e.g. a subpackage) or
        "module:attribute" (the name is an attribute of it).
    """

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = exports[name].partition(":")
        value = importlib.import_module(module)
        if attribute:
            value = getattr(value, attribute)
        setattr(sys.modules[package], name, value)  # the next lookup skips __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
