"""mkdocs hooks: the API reference, generated from the source tree; the README as the site's
guide page; the result tables and plots.

The API reference has one page per public module (`api/nn/attention.md` renders
`tfx.nn.attention`), one index page per package (`api/nn/index.md`: its docstring, what its
`__init__` defines, and a table of its modules with their summaries) and `api/index.md`, the
table of the top-level packages. The pages and their nav section are made at build time from
the files under tfx/, so a module that is added, moved or removed needs no docs edit. Summaries
are read from the sources with `ast`, as mkdocstrings reads the rest: the build imports no tfx
(and needs no jax).

The README and the guides in docs/ link to result tables and plots under experiments/results/
and benchmarks/results/; those files join the site too (at the same paths), so the strict build
checks each such link and anchor instead of skipping them. Links are written to work on GitHub:
the README links `docs/ops.md` and `benchmarks/results/x.md` from the repository's root, a guide
links `../benchmarks/results/x.md` and `../README.md` from docs/. On the site the guides, the
README (as guide.md) and the results all sit under one root, so those prefixes are rewritten.
"""

from __future__ import annotations

import ast
import json
import logging
import pathlib
import posixpath
import re

from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ("experiments/results", "benchmarks/results")
API_INDEX = "api/index.md"
API_INTRO = ("tfx's packages and top-level modules. A package's page has its docstring and a"
             " table of its modules; a module's page, its classes and functions.")
# A sentence ends at a full stop followed by a capital or a code span; "e.g. by" and
# "et al. 2023" go on.
SENTENCE_END = re.compile(r"\.(?=\s+[A-Z`]|$)")
log = logging.getLogger("mkdocs.hooks.tfx")


def on_config(config):
    """Expands the nav's entry for api/index.md into the API reference: the index, then a
    section per package (its index page, then its modules and subpackages)."""
    nav = config.nav or []
    for i, entry in enumerate(nav):
        if isinstance(entry, dict) and list(entry.values()) == [API_INDEX]:
            (title,) = entry
            nav[i] = {title: [API_INDEX, *api_nav(public_modules())]}
            return config
    # Without the entry the generated pages are built but no nav leads to them.
    log.warning("mkdocs.yml's nav has no entry for %s: the API reference is not in the nav",
                API_INDEX)
    return config


def on_files(files: Files, config) -> Files:
    """Adds the README (as guide.md), the result files and the API pages to the site's files;
    mkdocs builds the nav after this hook, so its API section finds the generated pages."""
    # The README links docs/architecture.md from the repository root; on the site both pages
    # are at the top.
    readme = (ROOT / "README.md").read_text(encoding="utf-8").replace("](docs/", "](")
    files.append(File.generated(config, "guide.md", content=readme))
    for folder in RESULTS:
        for path in sorted((ROOT / folder).glob("*")):
            if path.suffix in (".md", ".png"):
                files.append(File.generated(config, f"{folder}/{path.name}",
                                            abs_src_path=str(path)))
    for uri, content in api_pages(public_modules()).items():
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A guide in docs/ links the results and the README from one folder down, as GitHub
    resolves them; on the site they are siblings of the guide."""
    if page.file.src_uri.count("/") == 0 and page.file.src_uri != "guide.md":
        for folder in RESULTS:
            markdown = markdown.replace(f"](../{folder}/", f"]({folder}/")
        markdown = markdown.replace("](../README.md", "](guide.md")
    return markdown


def public_modules() -> dict[str, pathlib.Path]:
    """tfx's modules by dotted name, each with its source file (a package's `__init__.py`),
    sorted by name; except private ones (a leading underscore), the `tfx` command (tfx.cli,
    documented by its --help) and the top-level package."""
    modules = {}
    for path in sorted((ROOT / "tfx").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts) or parts == ("tfx",) or parts[:2] == (
                "tfx", "cli"):
            continue
        modules[".".join(parts)] = path
    return dict(sorted(modules.items()))


def is_package(path: pathlib.Path) -> bool:
    """Whether the module whose source is `path` is a package."""
    return path.name == "__init__.py"


def page_uri(name: str, path: pathlib.Path) -> str:
    """The page of module `name` under docs/: api/nn/attention.md for tfx.nn.attention,
    api/nn/index.md for the package tfx.nn (an index page, which a nav section opens)."""
    folder = "/".join(["api", *name.split(".")[1:]])
    return f"{folder}/index.md" if is_package(path) else f"{folder}.md"


def children(modules: dict[str, pathlib.Path], parent: str) -> list[str]:
    """The modules and subpackages directly inside package `parent`, by name."""
    return [name for name in modules if name.rpartition(".")[0] == parent]


def api_nav(modules: dict[str, pathlib.Path], parent: str = "tfx") -> list:
    """The nav entries of `parent`'s modules: a page per module, a section per package whose
    first page is the package's index. The top-level ones are labelled tfx.nn, the others by
    their last name (attention), as they sit inside their package's section."""
    entries = []
    for name in children(modules, parent):
        label = name if parent == "tfx" else name.rpartition(".")[2]
        uri = page_uri(name, modules[name])
        entries.append({label: [uri, *api_nav(modules, name)] if is_package(modules[name])
                        else uri})
    return entries


def api_pages(modules: dict[str, pathlib.Path]) -> dict[str, str]:
    """The markdown of every API page, by its path under docs/."""
    table = module_table(modules, "tfx", API_INDEX)
    pages = {API_INDEX: f"# API reference\n\n{API_INTRO}\n\n{table}"}
    for name, path in modules.items():
        uri = page_uri(name, path)
        pages[uri] = (package_page(name, modules, uri) if is_package(path)
                      else f"::: {name}\n")
    return pages


def package_page(name: str, modules: dict[str, pathlib.Path], uri: str) -> str:
    """A package's index page: its docstring, what its `__init__` itself defines (it re-exports
    the rest, documented on the modules' pages) and the table of its modules."""
    members = defined_names(read_module(modules[name]))
    # json.dumps writes the names as a YAML flow list, which the `:::` options block reads.
    return (f"# {name}\n\n::: {name}\n    options:\n      show_root_heading: false\n"
            f"      members: {json.dumps(members) if members else 'false'}\n\n"
            f"## Modules\n\n{module_table(modules, name, uri)}")


def module_table(modules: dict[str, pathlib.Path], parent: str, uri: str) -> str:
    """A markdown table of `parent`'s modules, each linked from page `uri`, with its summary."""
    rows = ["| Module | Summary |", "| --- | --- |"]
    for name in children(modules, parent):
        link = posixpath.relpath(page_uri(name, modules[name]), posixpath.dirname(uri))
        rows.append(f"| [{name}]({link}) | {summary(read_module(modules[name]))} |")
    return "\n".join(rows) + "\n"


def read_module(path: pathlib.Path) -> ast.Module:
    """The syntax tree of a source file (read, never imported)."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def summary(tree: ast.Module) -> str:
    """The first sentence of a module's docstring, on one line, as a table cell. Not its first
    line: docstrings wrap, and a wrapped first line can end mid-phrase or inside a code span."""
    paragraph = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
    end = SENTENCE_END.search(paragraph)
    return (paragraph[:end.end()] if end else paragraph).replace("|", r"\|")


def defined_names(tree: ast.Module) -> list[str]:
    """The public functions and classes a module defines at its top level, in source order
    (not those it imports: mkdocstrings would render a package's re-exports a second time)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [node.name for node in tree.body
            if isinstance(node, kinds) and not node.name.startswith("_")]
