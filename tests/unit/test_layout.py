"""The size budgets of docs/architecture.md: functions that fit a screen, rooms of a size a
newcomer reads in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "torchkeel"
MAX_FUNCTION_LINES = 60


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def outermost_functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions and methods not defined inside another function: each is measured with
    everything defined inside it."""
    found, stack = [], [tree]
    while stack:
        for child in ast.iter_child_nodes(stack.pop()):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append(child)
            else:
                stack.append(child)
    return found


def span(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines from its ``def`` to its end, the functions and classes defined inside it
    included (moving a body into closures does not make it shorter), its docstring aside."""
    lines = function.end_lineno - function.lineno + 1
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        lines -= body[0].end_lineno - body[0].lineno + 1
    return lines


def test_no_function_is_longer_than_a_screen():
    over = {}
    for path in SRC.rglob("*.py"):
        for node in outermost_functions(ast.parse(path.read_text())):
            if span(node) > MAX_FUNCTION_LINES:
                over[f"{path.relative_to(SRC)}:{node.lineno} {node.name}"] = span(node)
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (nested functions included, docstrings aside): {over}"


def test_no_module_outgrows_its_budget():
    over = {str(p.relative_to(SRC)): lines(p) for p in SRC.rglob("*.py") if lines(p) > 450}
    assert not over, f"modules over 450 lines: {over}"
    over = {str(p.relative_to(SRC)): lines(p) for p in (SRC / "diagnose").rglob("*.py") if lines(p) > 400}
    assert not over, f"diagnose modules over 400 lines: {over}"


def test_the_probes_listeners_tell_each_other_through_events_not_calls():
    """A listener reads the shared ``ProbeState`` and emits events; it never reaches into another."""
    probe_dir = SRC / "diagnose" / "probe"
    listeners = {"modules", "backward", "optim", "data", "seeds", "habits", "loop", "scale", "losses"}
    reached = []
    for path in probe_dir.glob("*.py"):
        if path.name == "core.py":
            continue  # the probe itself installs and finishes them
        for node in ast.walk(ast.parse(path.read_text())):
            inner = node.value if isinstance(node, ast.Attribute) else None
            if (
                isinstance(inner, ast.Attribute)
                and inner.attr in listeners
                and (getattr(inner.value, "id", None) == "probe" or getattr(inner.value, "attr", None) == "probe")
            ):
                reached.append(f"{path.name}:{node.lineno} probe.{inner.attr}.{node.attr}")
    assert not reached, f"listeners reaching into each other: {reached}"
