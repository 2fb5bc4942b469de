"""The JAX stack's lower bounds in pyproject.toml are the versions that CI tests: .ci/run
installs .ci/lowest-versions.txt in a second venv and runs the fast tests there, so this checks
that the file pins exactly pyproject's lower bounds, for every package of that stack, and that
the installed versions here are not below them."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
STACK = ("jax", "flax", "optax", "chex", "orbax-checkpoint")


def _lower_bounds() -> dict[str, str]:
    """{name: version} of every `name>=version` requirement in [project] dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)(,.*)?", requirement)
        if match:
            bounds[match[1].lower()] = match[2]
    return bounds


def _pins() -> dict[str, str]:
    lines = (ROOT / ".ci" / "lowest-versions.txt").read_text().splitlines()
    pairs = (line.split("==") for line in lines if line and not line.startswith("#"))
    return {name.strip().lower(): version.strip() for name, version in pairs}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"[0-9.]+", version)[0].rstrip(".").split("."))


def test_the_lowest_versions_file_pins_pyprojects_lower_bounds():
    bounds, pins = _lower_bounds(), _pins()
    for name in STACK:
        assert name in bounds, f"pyproject.toml declares no lower bound for {name}"
        assert pins.get(name) == bounds[name], (name, pins.get(name), bounds[name])
    assert pins["jaxlib"] == pins["jax"]  # jaxlib moves with jax


def test_installed_versions_meet_the_bounds():
    for name, version in _lower_bounds().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert _release(installed) >= _release(version), (name, installed, version)
