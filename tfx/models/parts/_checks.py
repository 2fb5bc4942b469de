"""The checks that the sub-configs' `__post_init__` run on a field, each naming the field by its
dotted path in the model config (`moe.num_experts`) in the error it raises."""

from __future__ import annotations


def positive_int(name: str, value, minimum: int = 1) -> None:
    """TypeError unless `value` is an int (not a bool); ValueError when below `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def one_of(name: str, value, allowed: tuple) -> None:
    """ValueError unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def boolean(name: str, value) -> None:
    """TypeError unless `value` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
