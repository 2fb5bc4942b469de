"""No import cycles in tfx/: the module import graph, read statically, has no strongly
connected component of more than one module.

An edge `a -> b` is any `import tfx.b` / `from tfx.b import x` / relative import in module `a`,
at module level or inside a function or class (a deferred import hides a cycle, it does not
remove it). Imports under `if TYPE_CHECKING:` are not edges: they never run. `from pkg import
name` is an edge to `pkg.name` when that is a module, else to `pkg`. The parent packages that
Python imports on the way (`tfx`, `tfx.train` for `tfx.train.data`) are not edges, and neither
are the names that `tfx._lazy.lazy_exports` loads on first use.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `root`/tfx."""
    names = {}
    for path in sorted((root / "tfx").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    """Whether an `if` test is `TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST):
    """Every Import/ImportFrom node in `node` outside `if TYPE_CHECKING:` blocks."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
        return
    for child in ast.iter_child_nodes(node):
        typing_only = isinstance(child, ast.If) and _is_type_checking(child.test)
        for statement in child.orelse if typing_only else [child]:
            yield from _imports(statement)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: set[str]) -> set[str]:
    """The tfx modules that one import statement in `module` imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    base = node.module or ""
    if node.level:
        package = module.split(".")
        package = package[:len(package) - node.level + is_package]
        base = ".".join(package + ([base] if base else []))
    found = {f"{base}.{alias.name}" for alias in node.names} & known
    if len(found) < len(node.names) and base in known:
        found.add(base)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the tfx modules it imports (see the module docstring for what counts)."""
    files = _module_names(root)
    known = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set().union(*(_targets(n, module, is_package, known) for n in _imports(tree)))
        graph[module] = edges - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_graph_sees_deferred_imports_and_skips_type_checking_ones():
    graph = import_graph()
    assert "tfx.train.config" in graph["tfx.train.loop"]
    assert "tfx.train.chat" in graph["tfx.train.data"]  # imported inside a function
    assert "tfx.train.config" not in graph["tfx.train.feed"]  # under TYPE_CHECKING only


def test_cycles_finds_a_cycle_and_only_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_tfx_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles in tfx/:\n" + "\n".join(" <-> ".join(c) for c in found)
