"""The run ledger's code stays readable (issue 32): no function in ``gpu_energy_exporter/ledger/`` is longer than
60 lines, each billing rule (``ledger/billing.py``) is under 40, and no two of its modules import each other,
directly or round a circle (imports inside functions and under ``TYPE_CHECKING`` count too).

Read with ``ast`` from the source files, as a reviewer would count them: a function's lines run from its ``def``
(decorators aside) to its last line, docstring and comments included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEDGER = ROOT / "gpu_energy_exporter" / "ledger"
PREFIX = "gpu_energy_exporter.ledger"
MAX_FUNCTION_LINES = 60
MAX_RULE_LINES = 39  # "under 40"


def _functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in ``path``, nested ones included."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    out.append((name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, scope)

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def _over(paths: list[Path], limit: int) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{name} ({lines} lines)" for p in paths for name, lines in _functions(p)
            if lines > limit]


def test_no_function_in_the_ledger_is_longer_than_60_lines() -> None:
    paths = sorted(LEDGER.rglob("*.py"))
    assert len(paths) > 20 and any(lines > 30 for p in paths for _, lines in _functions(p))  # it reads them
    assert not _over(paths, MAX_FUNCTION_LINES), (
        "split these by what they do (the ledger's functions stay under "
        f"{MAX_FUNCTION_LINES} lines): {_over(paths, MAX_FUNCTION_LINES)}")


def test_every_billing_rule_is_under_40_lines() -> None:
    rules = LEDGER / "billing.py"
    assert len(_functions(rules)) > 10
    assert not _over([rules], MAX_RULE_LINES), _over([rules], MAX_RULE_LINES)


def _module(path: Path) -> str:
    parts = path.relative_to(LEDGER).with_suffix("").parts
    return ".".join((PREFIX, *parts)).removesuffix(".__init__")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The ledger's modules ``path`` imports, wherever the import statement is."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # `from ledger import runs` names a module; `from ledger.runs import Run` its module
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out & modules


def test_no_import_circle_between_the_ledgers_modules() -> None:
    paths = {_module(p): p for p in LEDGER.rglob("*.py")}
    graph = {m: _imports(p, set(paths)) - {m, PREFIX} for m, p in paths.items()}
    assert graph[f"{PREFIX}.summary"] >= {f"{PREFIX}.split", f"{PREFIX}.runs"}  # the scan sees both forms
    circles = []
    for start in graph:  # a module that reaches itself again
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == start:
                circles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
    assert not circles, f"modules of the ledger on an import circle: {sorted(circles)}"
