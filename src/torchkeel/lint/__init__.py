"""``keel lint``: static rules over the AST for PyTorch training code (see docs/lint.md)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from torchkeel.lint.engine import (
    LintFinding,
    LintReport,
    Rule,
    Skipped,
    lint_file,
    lint_source,
)
from torchkeel.lint.files import python_files
from torchkeel.lint.rules import PREVIEW, RULES

# Below this many files one process is faster than starting workers.
PARALLEL_FROM = 64


def select_rules(
    select: Iterable[str] | None = None, ignore: Iterable[str] | None = None, *, preview: bool = False
) -> list[Rule]:
    """Rules whose code starts with one of ``select`` (all when None) and with none of ``ignore``.

    A preview rule (``PREVIEW``: not yet measured precise on public code) runs only with
    ``preview=True`` or when ``select`` names its whole code: a prefix (``TK1``) does not choose it.
    """
    names = None if select is None else list(select)
    chosen = [
        r
        for code, r in RULES.items()
        if (preview or code not in PREVIEW or code in (names or ()))
        and (names is None or any(code.startswith(s) for s in names))
    ]
    return [r for r in chosen if not any(r.code.startswith(i) for i in ignore or ())]


def lint_paths(
    paths: Iterable[str],
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
    preview: bool = False,
    workers: int | None = None,
) -> LintReport:
    """Lint every Python file named or found under ``paths``; a file that does not parse as Python
    is skipped and counted (``LintReport.skipped``), never a finding.

    ``select``, ``ignore`` and ``preview`` choose the rules as ``select_rules`` does.
    Files are linted in ``workers`` processes (default: the usable CPUs, one process below
    ``PARALLEL_FROM`` files); the report is in file order whatever the number of workers.

    Raises:
        ConfigError: a path does not exist.
    """
    codes = [r.code for r in select_rules(select, ignore, preview=preview)]
    files = python_files(paths)
    workers = min(workers or _usable_cpus(), max(len(files) // PARALLEL_FROM, 1))
    if workers > 1:
        chunk = max(len(files) // (workers * 8), 1)
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(_lint_one, files, [codes] * len(files), chunksize=chunk))
    else:
        results = [_lint_one(path, codes) for path in files]
    findings = [f for found, _ in results for f in found]
    skipped = [s for _, s in results if s is not None]
    return LintReport(findings, len(files) - len(skipped), skipped)


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _lint_one(path: str, codes: Sequence[str]) -> tuple[list[LintFinding], Skipped | None]:
    return lint_file(path, [RULES[code] for code in codes])


__all__ = [
    "PREVIEW",
    "RULES",
    "LintFinding",
    "LintReport",
    "Rule",
    "Skipped",
    "lint_file",
    "lint_paths",
    "lint_source",
    "select_rules",
]
