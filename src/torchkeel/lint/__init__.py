"""``keel lint``: static rules over the AST for PyTorch training code (see docs/lint.md)."""

from __future__ import annotations

from collections.abc import Iterable

from torchkeel.lint.engine import (
    LintFinding,
    LintReport,
    Rule,
    lint_source,
    python_files,
)
from torchkeel.lint.rules import RULES


def select_rules(select: Iterable[str] | None = None, ignore: Iterable[str] | None = None) -> list[Rule]:
    """Rules whose code starts with one of ``select`` (all when None) and with none of ``ignore``."""
    chosen = [r for code, r in RULES.items() if select is None or any(code.startswith(s) for s in select)]
    return [r for r in chosen if not any(r.code.startswith(i) for i in ignore or ())]


def lint_paths(
    paths: Iterable[str], *, select: Iterable[str] | None = None, ignore: Iterable[str] | None = None
) -> LintReport:
    """Lint every Python file named or found under ``paths``.

    Raises:
        ConfigError: a path does not exist.
    """
    rules = select_rules(select, ignore)
    files = python_files(paths)
    findings: list[LintFinding] = []
    for path in files:
        with open(path, encoding="utf-8-sig", errors="replace") as fh:
            findings += lint_source(fh.read(), path, rules)
    return LintReport(findings, len(files))


__all__ = ["RULES", "LintFinding", "LintReport", "Rule", "lint_paths", "lint_source", "select_rules"]
