"""mkdocs hooks: the README as the site's guide page, and a check that the API pages name
every public module.

The README and the guides in docs/ link to result tables and plots under experiments/results/
and benchmarks/results/; those files join the site too (at the same paths), so the strict build
checks each such link and anchor instead of skipping them. Links are written to work on GitHub:
the README links `docs/ops.md` and `benchmarks/results/x.md` from the repository's root, a guide
links `../benchmarks/results/x.md` and `../README.md` from docs/. On the site the guides, the
README (as guide.md) and the results all sit under one root, so those prefixes are rewritten.
"""

from __future__ import annotations

import logging
import pathlib
import re

from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ("experiments/results", "benchmarks/results")
log = logging.getLogger("mkdocs.hooks.tfx")


def on_files(files: Files, config) -> Files:
    # The README links docs/architecture.md from the repository root; on the site both pages
    # are at the top.
    readme = (ROOT / "README.md").read_text(encoding="utf-8").replace("](docs/", "](")
    files.append(File.generated(config, "guide.md", content=readme))
    for folder in RESULTS:
        for path in sorted((ROOT / folder).glob("*")):
            if path.suffix in (".md", ".png"):
                files.append(File.generated(config, f"{folder}/{path.name}",
                                            abs_src_path=str(path)))
    _check_modules_named(pathlib.Path(config.docs_dir) / "api")
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A guide in docs/ links the results and the README from one folder down, as GitHub
    resolves them; on the site they are siblings of the guide."""
    if page.file.src_uri.count("/") == 0 and page.file.src_uri != "guide.md":
        for folder in RESULTS:
            markdown = markdown.replace(f"](../{folder}/", f"]({folder}/")
        markdown = markdown.replace("](../README.md", "](guide.md")
    return markdown


def public_modules() -> list[str]:
    """Dotted names of tfx's modules, except private ones (a leading underscore), the `tfx`
    command (tfx.cli, documented by its --help) and the top-level package."""
    names = []
    for path in sorted((ROOT / "tfx").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts) or parts == ("tfx",) or parts[:2] == (
                "tfx", "cli"):
            continue
        names.append(".".join(parts))
    return names


def named_modules(api_dir: pathlib.Path) -> set[str]:
    """The modules that the pages of `api_dir` render (their `::: name` lines)."""
    named = set()
    for page in api_dir.glob("*.md"):
        named |= set(re.findall(r"^::: ([\w.]+)", page.read_text(encoding="utf-8"), re.M))
    return named


def _check_modules_named(api_dir: pathlib.Path) -> None:
    for module in sorted(set(public_modules()) - named_modules(api_dir)):
        # A warning fails the strict build: a new module needs its `::: module` line.
        log.warning("public module %s is on no page of docs/api/", module)
