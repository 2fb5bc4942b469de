"""The API reference site's own checks, without building it: every public module is on a page
of docs/api/ (docs/hooks.py fails `mkdocs build --strict` otherwise), and the griffe extension
that lets docstring sections follow one another without a blank line (docs/griffe_sections.py).
Needs mkdocs and griffe (the `docs` extra)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("griffe")
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_module_is_on_an_api_page():
    hooks = _load("hooks")
    named = hooks.named_modules(DOCS / "api")
    modules = hooks.public_modules()
    assert "tfx.ops.attention" in modules and "tfx.models.decoder" in modules
    assert not any(m.startswith("tfx.cli") or "._" in m for m in modules)
    assert set(modules) <= named, f"on no page of docs/api/: {sorted(set(modules) - named)}"
    assert named <= set(modules), f"pages name modules that do not exist: {named - set(modules)}"


def test_a_section_after_a_section_gets_its_blank_line():
    separate = _load("griffe_sections").separate_sections
    text = "Summary.\n\nArgs:\n  x: input.\nReturns:\n  y.\nRaises:\n  ValueError: bad x."
    assert separate(text) == ("Summary.\n\nArgs:\n  x: input.\n\nReturns:\n  y.\n\n"
                              "Raises:\n  ValueError: bad x.")
    assert separate(separate(text)) == separate(text)  # already separated: unchanged


def test_section_titles_in_code_fences_and_prose_are_left_alone():
    separate = _load("griffe_sections").separate_sections
    fenced = "Example.\n```\nx = f()\nReturns:\n```"
    assert separate(fenced) == fenced
    prose = "It Returns: nothing."
    assert separate(prose) == prose
