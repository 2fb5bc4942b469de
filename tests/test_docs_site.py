"""The API reference site's own checks, without building it: the pages and nav that docs/hooks.py
generates from the source tree (a page per public module, an index per package), and the griffe
extension that lets docstring sections follow one another without a blank line
(docs/griffe_sections.py). Needs mkdocs and griffe (the `docs` extra)."""

from __future__ import annotations

import ast
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


def _nav_pages(entries: list) -> list[str]:
    """Every page of a nav section, depth first."""
    pages = []
    for entry in entries:
        for value in [entry] if isinstance(entry, str) else entry.values():
            pages += [value] if isinstance(value, str) else _nav_pages(value)
    return pages


def test_public_modules_are_tfx_modules_but_private_ones_and_the_command():
    modules = _load("hooks").public_modules()
    assert "tfx.ops.attention" in modules and "tfx.models.decoder" in modules
    assert modules["tfx.ops.attention"].name == "__init__.py"
    assert not any(m == "tfx" or m.startswith("tfx.cli") or "._" in m for m in modules)


def test_every_public_module_has_one_page_in_the_nav():
    hooks = _load("hooks")
    modules = hooks.public_modules()
    pages = hooks.api_pages(modules)
    in_nav = [hooks.API_INDEX, *_nav_pages(hooks.api_nav(modules))]
    assert len(in_nav) == len(set(in_nav)) == len(modules) + 1
    assert set(in_nav) == set(pages)
    assert pages["api/nn/attention.md"] == "::: tfx.nn.attention\n"
    assert "::: tfx.ops.attention\n" in pages["api/ops/attention/index.md"]
    assert "[tfx.ops](ops/index.md)" in pages[hooks.API_INDEX]


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_a_package_page_has_its_definitions_and_a_table_of_its_modules(tmp_path):
    hooks = _load("hooks")
    modules = {
        "tfx.demo": _write(tmp_path / "demo/__init__.py", '"""Demo: a package.\n\nMore."""\n'
                           "from os import path\n\ndef load(): ...\n\ndef _hidden(): ...\n"
                           "class Model: ...\n"),
        "tfx.demo.inner": _write(tmp_path / "demo/inner/__init__.py", '"""Inner."""\n'),
        "tfx.demo.sub": _write(tmp_path / "demo/sub.py", '"""a | b, e.g. by\nhand. Next."""\n'),
    }
    page = hooks.package_page("tfx.demo", modules, "api/demo/index.md")
    assert page.startswith("# tfx.demo\n\n::: tfx.demo\n")
    assert 'members: ["load", "Model"]' in page
    assert "| [tfx.demo.inner](inner/index.md) | Inner. |" in page
    assert "| [tfx.demo.sub](sub.md) | a \\| b, e.g. by hand. |" in page
    assert hooks.api_nav(modules) == [{"tfx.demo": [
        "api/demo/index.md", {"inner": ["api/demo/inner/index.md"]}, {"sub": "api/demo/sub.md"}]}]


def test_a_summary_is_the_first_sentence_of_the_docstring():
    summary = _load("hooks").summary
    tree = ast.parse('"""Keys (Li et al. 2021), wrapped\nover lines. `x` next.\n\nMore."""')
    assert summary(tree) == "Keys (Li et al. 2021), wrapped over lines."
    assert summary(ast.parse("x = 1")) == ""


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
