"""The shape of the package's code (issue 18): small functions, generic layers that know nothing
of fine-tuning methods, sharding rules without regular expressions, small model configs.

A check marked xfail(strict=True) is the goal of work still under way: remove the marker when
that work lands (strict: the test then fails until the marker goes).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tfx"
MAX_FUNCTION_LINES = 50
MAX_CONFIG_FIELDS = 20
# Fine-tuning methods live in tfx.peft; the generic layers must not name them.
GENERIC_DIRS = ("ops", "nn", "models")
PEFT_WORDS = re.compile(r"\b(prefix|prompt|adapters?|lora|peft)\b", re.IGNORECASE)


def _sources(*dirs: str) -> list[pathlib.Path]:
    """Every .py file under the package (or under its sub-directories `dirs`), sorted."""
    roots = [PACKAGE / d for d in dirs] if dirs else [PACKAGE]
    return sorted(f for root in roots for f in root.rglob("*.py"))


def _code_lines(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of code of a function: from its first body statement after the docstring to its
    end, the lines that are neither blank nor only a comment."""
    body = node.body
    if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    if not body:
        return 0
    span = lines[body[0].lineno - 1:node.end_lineno]
    return sum(1 for line in span if line.strip() and not line.strip().startswith("#"))


def _functions(tree: ast.AST, scope: str = ""):
    """(qualified name, node) of every function and method in `tree`, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        name = f"{scope}{getattr(node, 'name', '')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield name, node
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, scope)


def _long_functions() -> list[str]:
    """"tfx/file:function:lines" of every function of more than MAX_FUNCTION_LINES lines of
    code."""
    out = []
    for path in _sources():
        source = path.read_text()
        lines = source.splitlines()
        rel = path.relative_to(PACKAGE).as_posix()
        for name, node in _functions(ast.parse(source, str(path))):
            count = _code_lines(lines, node)
            if count > MAX_FUNCTION_LINES:
                out.append(f"tfx/{rel}:{name}:{count}")
    return out


def test_functions_have_at_most_50_lines_of_code():
    offenders = _long_functions()
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} code lines: {offenders}"


def test_generic_layers_do_not_name_peft_methods():
    offenders = [f"tfx/{path.relative_to(PACKAGE).as_posix()}:{number}: {line.strip()}"
                 for path in _sources(*GENERIC_DIRS)
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if PEFT_WORDS.search(line)]
    assert not offenders, "PEFT words in generic layers:\n" + "\n".join(offenders)


def test_sharding_rules_use_no_regular_expressions():
    path = PACKAGE / "parallel" / "rules.py"
    offenders = [f"tfx/parallel/rules.py:{node.lineno}: {ast.unparse(node)}"
                 for node in ast.walk(ast.parse(path.read_text()))
                 if (isinstance(node, ast.Import) and any(a.name == "re" for a in node.names))
                 or (isinstance(node, ast.ImportFrom) and node.module == "re")]
    assert not offenders, f"rules.py imports re: {offenders}"


def test_model_configs_have_at_most_20_fields():
    from tfx.models import config  # here: the other checks only read the source

    classes = (config.DecoderConfig, config.EncoderConfig, config.EncoderDecoderConfig)
    offenders = [f"tfx/models/config.py:{cls.__name__}: {len(dataclasses.fields(cls))} fields"
                 for cls in classes if len(dataclasses.fields(cls)) > MAX_CONFIG_FIELDS]
    assert not offenders, f"configs over {MAX_CONFIG_FIELDS} top-level fields: {offenders}"
