"""The lint engine: parse a file once into a ``Source`` (tree, parents, helpers), run every rule
over it, drop what a ``# keel: noqa[CODE]`` comment silences.

A rule is a plain function ``check(source) -> Iterator[(node, message)]`` registered with its code,
finding id, severity and fix in ``RULES``; rules never print and never import the code they read.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

_NOQA = re.compile(r"#\s*keel:\s*noqa(?:\[([A-Za-z0-9_,\s]+)\])?")


@dataclasses.dataclass
class LintFinding:
    """One rule violation at ``path:line:col``."""

    code: str
    id: str | None
    severity: str
    path: str
    line: int
    col: int
    message: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Rule:
    """``code`` (TK1xx), the diagnose finding ``id`` it prevents (or None), what it checks."""

    code: str
    name: str
    id: str | None
    severity: str
    summary: str
    fix: str
    check: Callable[[Source], Iterable[tuple[ast.AST, str]]]
    in_tests: bool = True
    """False for rules about what a training run does over time (a checkpoint rewritten, an epoch's
    order, a device): a test file's saves, loops and mocks are not that run."""


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A file that is not Python (it does not parse: a template, another language's code)."""

    path: str
    line: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class LintReport:
    findings: list[LintFinding]
    files: int
    """Files linted (parsed as Python)."""
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    """Files that do not parse as Python: counted, never a finding."""


def dotted(node: ast.AST | None) -> str:
    """``torch.nn.functional.softmax`` for an attribute chain, ``f()`` for a call, "" otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    if isinstance(node, ast.Call):
        base = dotted(node.func)
        return f"{base}()" if base else ""
    return ""


def call_name(node: ast.AST) -> str:
    """The dotted name of a call's function (``opt.step``), "" when ``node`` is not a call."""
    return dotted(node.func) if isinstance(node, ast.Call) else ""


def last(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def grad_free(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with ``torch.no_grad()`` or ``torch.inference_mode()`` (or a wrapper named so)."""
    return any("no_grad" in dotted(d) or "inference_mode" in dotted(d) for d in fn.decorator_list)


class Source:
    """One parsed file and the questions rules ask about it."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text
        self.tree = ast.parse(text, filename=path)
        self.nodes: list[ast.AST] = list(ast.walk(self.tree))
        """Every node of the file, in ``ast.walk``'s order: walked once, shared by every rule."""
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in self.nodes:
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.all_calls: list[ast.Call] = [n for n in self.nodes if isinstance(n, ast.Call)]
        self.memo: dict[str, Any] = {}
        """What several rules compute from the file alone (their training loops), computed once."""
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.assigned: dict[str, list[ast.expr]] = {}
        for node in self.nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, node)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in _target_names(target):
                        self.assigned.setdefault(name, []).append(node.value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                for name in _target_names(node.target):
                    self.assigned.setdefault(name, []).append(node.value)

    @functools.cached_property
    def is_test(self) -> bool:
        """A test file: under a ``tests``/``test`` directory, ``test_*.py``, ``*_test.py`` or ``conftest.py``."""
        parts = Path(self.path).parts
        name = parts[-1] if parts else ""
        return (
            any(p in ("tests", "test") for p in parts[:-1])
            or name.startswith("test_")
            or name.endswith("_test.py")
            or name == "conftest.py"
        )

    def calls(self, root: ast.AST | None = None) -> Iterator[ast.Call]:
        if root is None or root is self.tree:
            yield from self.all_calls
            return
        for node in ast.walk(root):
            if isinstance(node, ast.Call):
                yield node

    @functools.cached_property
    def imported_modules(self) -> set[str]:
        """The names ``import x`` / ``import x as y`` bind in this file."""
        return {
            a.asname or a.name.split(".")[0] for node in self.nodes if isinstance(node, ast.Import) for a in node.names
        }

    def calls_of(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.Call]:
        """The calls in this file of the function ``fn`` (``name(...)``) or, for a method,
        ``obj.name(...)`` on anything but an imported module (``torch.save`` is not ``Trainer.save``)."""
        if isinstance(self.parents.get(fn), ast.ClassDef):
            return [
                c
                for c in self.calls()
                if isinstance(c.func, ast.Attribute)
                and c.func.attr == fn.name
                and dotted(c.func.value).split(".")[0] not in self.imported_modules
            ]
        return [c for c in self.calls() if isinstance(c.func, ast.Name) and c.func.id == fn.name]

    def enclosing(self, node: ast.AST, *types: type) -> ast.AST | None:
        node = self.parents.get(node)
        while node is not None and not isinstance(node, types):
            node = self.parents.get(node)
        return node

    def function_of(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        return self.enclosing(node, ast.FunctionDef, ast.AsyncFunctionDef)  # type: ignore[return-value]

    def method_name(self, node: ast.AST) -> str | None:
        """``forward`` / ``__getitem__`` when ``node`` lies in such a method of a class."""
        fn = self.function_of(node)
        while fn is not None:
            if isinstance(self.parents.get(fn), ast.ClassDef):
                return fn.name
            fn = self.function_of(fn)
        return None

    def in_main_guard(self, node: ast.AST) -> bool:
        parent = self.parents.get(node)
        while parent is not None:
            if (
                isinstance(parent, ast.If)
                and "__name__" in ast.unparse(parent.test)
                and "__main__" in ast.unparse(parent.test)
            ):
                return True
            parent = self.parents.get(parent)
        return False

    def guards(self, node: ast.AST, stop: ast.AST | None = None) -> frozenset[tuple[str, bool]]:
        """The ``if`` conditions under which ``node`` runs, up to ``stop`` or its function: each as
        (the condition's text, whether it holds there). ``if not x`` and ``x is None`` read as
        ("x", False), ``x is not None`` as ("x", True)."""
        found: set[tuple[str, bool]] = set()
        child, parent = node, self.parents.get(node)
        while parent is not None and parent is not stop:
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                break
            if isinstance(parent, ast.If) and child is not parent.test:
                text, holds = _condition(parent.test)
                found.add((text, holds if any(child is s for s in parent.body) else not holds))
            child, parent = parent, self.parents.get(parent)
        return frozenset(found)

    def exclusive(self, a: ast.AST, b: ast.AST) -> bool:
        """``a`` and ``b`` never run in the same pass: one needs a condition that the other needs
        false (the two branches of one ``if``, or ``if amp:`` ... ``if not amp:``)."""
        other = self.guards(b)
        return any((text, not holds) in other for text, holds in self.guards(a))

    def assigned_from(self, name: str, predicate: Callable[[ast.expr], bool]) -> bool:
        """True when some assignment to ``name`` (a simple or ``self.x`` name) has a value matching."""
        return any(predicate(value) for value in self.assigned.get(name, []))

    def loop_names(self, node: ast.AST) -> set[str]:
        """Names bound by the ``for`` loops and comprehensions around ``node`` in its function."""
        names: set[str] = set()
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if isinstance(parent, (ast.For, ast.AsyncFor)):
                names |= {n.id for n in ast.walk(parent.target) if isinstance(n, ast.Name)}
            elif isinstance(parent, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                names |= {n.id for g in parent.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
            parent = self.parents.get(parent)
        return names

    def reaches(
        self, expr: ast.AST, predicate: Callable[[ast.AST], bool], depth: int = 4, _seen: set[str] | None = None
    ) -> bool:
        """True when a node of ``expr`` matches ``predicate``, directly or in the values assigned to
        the names it uses (``depth`` assignments deep, each name followed once): data flow by name,
        file-wide."""
        seen = set() if _seen is None else _seen
        for node in ast.walk(expr):
            if predicate(node):
                return True
            if depth and isinstance(node, ast.Name) and node.id not in seen:
                seen.add(node.id)
                if any(self.reaches(v, predicate, depth - 1, seen) for v in self.assigned.get(node.id, [])):
                    return True
        return False

    def sibling(self, module: str) -> Source | None:
        """The parsed file of a module imported from this file's folder (``from model import Net``),
        or None when there is none (the module is installed, or does not parse)."""
        return _sibling(os.path.dirname(os.path.abspath(self.path)), module)

    def folder_calls(self, names: set[str]) -> bool:
        """True when this file or a ``.py`` file next to it calls a function named in ``names``
        (``torch.manual_seed`` in the training script next to ``datasets.py``)."""
        if any(last(call_name(c)) in names for c in self.calls()):
            return True
        pattern = r"\b(?:%s)\s*\(" % "|".join(map(re.escape, sorted(names)))
        return _folder_matches(os.path.dirname(os.path.abspath(self.path)), pattern)

    def package_matches(self, pattern: str) -> bool:
        """True when ``pattern`` (a regular expression) occurs in a ``.py`` file next to this one
        or, when this folder is a package, in its parent folder (``utils/segment/data.py`` and the
        seeding helper in ``utils/general.py``)."""
        folder = os.path.dirname(os.path.abspath(self.path))
        if _folder_matches(folder, pattern):
            return True
        return os.path.isfile(os.path.join(folder, "__init__.py")) and _folder_matches(os.path.dirname(folder), pattern)

    def project_matches(self, pattern: str, levels: int = 2) -> bool:
        """True when ``pattern`` (a regular expression) occurs in this file, a ``.py`` file next to
        it, or one in the ``levels`` folders above (the training script at the root of the
        repository that sets a default for ``layers/functions/detection.py``)."""
        if re.search(pattern, self.text):
            return True
        folder = os.path.dirname(os.path.abspath(self.path))
        for _ in range(levels + 1):
            if _folder_matches(folder, pattern):
                return True
            folder = os.path.dirname(folder)
        return False

    def imported_from(self, name: str) -> str | None:
        """The module that ``from MODULE import name`` (or ``from .MODULE``) in this file names, or None."""
        for node in self.nodes:
            if isinstance(node, ast.ImportFrom) and (node.module or node.level):
                if any((a.asname or a.name) == name for a in node.names):
                    return node.module or "."  # from . import name: this package
        return None

    def class_def(self, name: str) -> ast.ClassDef | None:
        return next((n for n in self.nodes if isinstance(n, ast.ClassDef) and n.name == name), None)

    def is_module_class(self, name: str) -> bool:
        """A class defined here that subclasses something ending in ``Module`` (nn.Module)."""
        node = self.class_def(name)
        return node is not None and any(dotted(b).endswith("Module") for b in node.bases)

    def constructed(self, value: ast.AST) -> tuple[ast.Call | None, Source | None, ast.ClassDef | None]:
        """For ``Net(...).to(device)``: the constructor call, and the file and class that define
        ``Net`` when this file or a sibling file does (else None, None)."""
        while (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in {"to", "cuda"}
        ):
            value = value.func.value
        if not isinstance(value, ast.Call):
            return None, None, None
        name = call_name(value)
        cls = last(name)
        node = self.class_def(cls)
        if node is not None:
            return value, self, node
        module = name.rsplit(".", 1)[0] if "." in name else self.imported_from(cls)
        where = self.sibling(module) if module else None
        node = where.class_def(cls) if where is not None else None
        return value, (where if node is not None else None), node


@functools.lru_cache(maxsize=64)
def _sibling(folder: str, module: str) -> Source | None:
    relative = module.replace(".", os.sep)
    for candidate in (os.path.join(folder, relative + ".py"), os.path.join(folder, relative, "__init__.py")):
        if os.path.isfile(candidate):
            try:
                with open(candidate, encoding="utf-8-sig", errors="replace") as fh:
                    return Source(candidate, fh.read())
            except (SyntaxError, ValueError):
                return None
    return None


@functools.lru_cache(maxsize=1024)
def _folder_matches(folder: str, regex: str) -> bool:
    pattern = re.compile(regex)
    try:
        entries = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
    except OSError:
        return False
    for name in entries:
        with open(os.path.join(folder, name), encoding="utf-8-sig", errors="replace") as fh:
            if pattern.search(fh.read()):
                return True
    return False


@functools.lru_cache(maxsize=1)
def torch_version() -> tuple[int, int] | None:
    """The installed torch's (major, minor), read from its metadata: lint never imports torch.
    None when torch is not installed where lint runs."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _condition(test: ast.expr) -> tuple[str, bool]:
    """``not x`` -> ("x", False); ``x is None`` -> ("x", False); ``x is not None`` -> ("x", True)."""
    holds = True
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, holds = test.operand, not holds
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], (ast.Is, ast.IsNot))
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    ):
        holds = holds if isinstance(test.ops[0], ast.IsNot) else not holds
        test = test.left
    return ast.unparse(test), holds


def _target_names(target: ast.AST) -> list[str]:
    if isinstance(target, (ast.Name, ast.Attribute)):
        return [dotted(target)]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _target_names(elt)]
    return []


def _silenced(line: str, code: str) -> bool:
    match = _NOQA.search(line)
    if not match:
        return False
    codes = match.group(1)
    return codes is None or code in {c.strip().upper() for c in codes.split(",")}


def lint_source(text: str, path: str, rules: Iterable[Rule]) -> list[LintFinding]:
    """Every finding of ``rules`` in one file's text.

    Raises:
        SyntaxError: the text is not Python (``lint_file`` counts such a file as skipped).
    """
    source = Source(path, text)
    lines = text.splitlines()
    found: dict[tuple[str, int, int], LintFinding] = {}
    for rule in rules:
        if source.is_test and not rule.in_tests:
            continue
        for node, message in rule.check(source):
            line, col = getattr(node, "lineno", 1), getattr(node, "col_offset", 0)
            if 0 < line <= len(lines) and _silenced(lines[line - 1], rule.code):
                continue
            found.setdefault(
                (rule.code, line, col),
                LintFinding(rule.code, rule.id, rule.severity, path, line, col, message, rule.fix),
            )
    return sorted(found.values(), key=lambda f: (f.line, f.col, f.code))


def lint_file(path: str, rules: Iterable[Rule]) -> tuple[list[LintFinding], Skipped | None]:
    """``lint_source`` of the file at ``path``: its findings, or why it was skipped (it does not
    parse as Python: a ``.py`` template with ``{{ }}``, Python 2, another language)."""
    with open(path, encoding="utf-8-sig", errors="replace") as fh:
        text = fh.read()
    try:
        return lint_source(text, path, rules), None
    except (SyntaxError, ValueError) as exc:  # ValueError: a NUL byte in the text
        line = getattr(exc, "lineno", None) or 1
        return [], Skipped(path, line, f"does not parse as Python: {getattr(exc, 'msg', None) or exc}")
