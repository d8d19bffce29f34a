"""Strict precision of each ``keel lint`` rule on public trees, from findings judged by hand.

Not a test: it prints figures. Every rule runs (preview ones too); each finding is joined by
(path, line, code) with the labels file of its tree, and the table says per rule: trees with a
finding, findings, labelled, true, false, debatable, and strict precision (true / labelled).
Findings not labelled yet are listed under the table, and so are labels no finding matches.

    python bench/lint_precision.py TREES... [--labels bench/lint_labels] [--markdown] [--stub]

Each TREES folder holds one folder per public repository, named ``<owner>__<name>``, extracted at the commit
its labels file names (outside this repository), e.g.::

    git --git-dir=MIRROR archive COMMIT | tar -x -C TREES/<owner>__<name>

A labels file, ``bench/lint_labels/<owner>__<name>.json``::

    {"repo": "owner/name", "commit": "40 hex digits", "note": "...",
     "labels": [{"path": "train.py", "line": 12, "code": "TK116",
                 "verdict": "true" | "false" | "debatable" | null, "why": "..."}]}

Where a rule has more than ``SAMPLE`` findings in one tree, only a sample of ``SAMPLE`` is
labelled, drawn with a seed made of the tree's and the rule's names (the same sample every run).
``--stub`` appends the findings still to be labelled to their labels files, verdict null.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from torchkeel.lint import PREVIEW, RULES, LintFinding, lint_paths

SAMPLE = 15
VERDICTS = ("true", "false", "debatable")
Key = tuple[str, int, str]


def tree_findings(tree: Path) -> list[LintFinding]:
    """Every rule's findings in ``tree`` (preview rules included), paths relative to it."""
    report = lint_paths([str(tree)], select=list(RULES))  # each code named: preview rules run too
    for f in report.findings:
        f.path = str(Path(f.path).relative_to(tree))
    return report.findings


def to_label(findings: list[LintFinding], tree: str) -> list[LintFinding]:
    """The findings to judge: all of a rule's, or a seeded sample of ``SAMPLE`` where it has more."""
    by_code: dict[str, list[LintFinding]] = defaultdict(list)
    for f in findings:
        by_code[f.code].append(f)
    chosen = []
    for code, found in sorted(by_code.items()):
        found.sort(key=lambda f: (f.path, f.line, f.col))
        chosen += found if len(found) <= SAMPLE else random.Random(f"{tree}/{code}").sample(found, SAMPLE)
    return chosen


def tree_dirs(folders: list[Path]) -> list[Path]:
    """The ``<owner>__<name>`` folders under ``folders``, by name."""
    return sorted((p for folder in folders for p in folder.iterdir() if p.is_dir()), key=lambda p: p.name.lower())


def load_labels(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"repo": path.stem.replace("__", "/", 1), "commit": None, "labels": []}
    return json.loads(path.read_text())


def dump(data: dict[str, Any]) -> str:
    """The labels file's text: one label a line, so that a diff shows one verdict."""
    head = {k: v for k, v in data.items() if k != "labels"}
    lines = [f"  {json.dumps(x, ensure_ascii=False)}" for x in data["labels"]]
    return json.dumps(head, indent=1, ensure_ascii=False)[:-2] + ',\n "labels": [\n' + ",\n".join(lines) + "\n ]\n}\n"


def measure(trees: list[Path], labels_dir: Path, stub: bool) -> tuple[dict[str, dict[str, int]], list[str], list[str]]:
    """Per rule counts, the findings not labelled yet and the labels no finding matches."""
    rows: dict[str, dict[str, int]] = {code: defaultdict(int) for code in RULES}
    todo, stale = [], []
    for tree in tree_dirs(trees):
        labels_path = labels_dir / f"{tree.name}.json"
        data = load_labels(labels_path)
        verdicts: dict[Key, str | None] = {(x["path"], x["line"], x["code"]): x["verdict"] for x in data["labels"]}
        findings = tree_findings(tree)
        for code in {f.code for f in findings}:
            rows[code]["trees"] += 1
        for f in findings:
            rows[f.code]["findings"] += 1
        for f in to_label(findings, tree.name):
            verdict = verdicts.get((f.path, f.line, f.code))
            if verdict in VERDICTS:
                rows[f.code]["labelled"] += 1
                rows[f.code][verdict] += 1
                continue
            todo.append(f"{tree.name}/{f.path}:{f.line}: {f.code} {f.message}")
            if (f.path, f.line, f.code) not in verdicts:
                verdicts[(f.path, f.line, f.code)] = None
                data["labels"].append({"path": f.path, "line": f.line, "code": f.code, "verdict": None, "why": ""})
        seen = {(f.path, f.line, f.code) for f in findings}
        stale += [f"{tree.name}/{p}:{n}: {c}" for p, n, c in verdicts if (p, n, c) not in seen]
        if stub and data["labels"]:
            data["labels"].sort(key=lambda x: (x["path"], x["line"], x["code"]))
            labels_path.write_text(dump(data))
    return rows, todo, stale


def precision(row: dict[str, int]) -> str:
    return f"{100 * row['true'] / row['labelled']:.0f} %" if row["labelled"] else "—"


def table(rows: dict[str, dict[str, int]], markdown: bool) -> str:
    head = ["rule", "set", "trees", "findings", "labelled", "true", "false", "debatable", "strict precision"]
    lines = []
    for preview in (False, True):
        total: dict[str, int] = defaultdict(int)
        for code in RULES:
            if (code in PREVIEW) != preview:
                continue
            row = rows[code]
            for k in ("findings", "labelled", *VERDICTS):
                total[k] += row[k]
            cells = [row[k] for k in ("trees", "findings", "labelled", *VERDICTS)]
            lines.append(
                [f"`{code}`" if markdown else code, "preview" if preview else "default", *cells, precision(row)]
            )
        name = "all preview" if preview else "all default"
        lines.append([name, "", "", *[total[k] for k in ("findings", "labelled", *VERDICTS)], precision(total)])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(str(c) for c in line) + " |" for line in lines])
    return "\n".join(
        f"{line[0]:12s} {line[1]:8s}" + "".join(f"{c!s:>10s}" for c in line[2:]) for line in [head, *lines]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", type=Path, nargs="+", help="folders of <owner>__<name> folders")
    parser.add_argument("--labels", type=Path, default=Path(__file__).parent / "lint_labels")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--stub", action="store_true", help="append unlabelled findings to the labels files")
    args = parser.parse_args()
    for tree in tree_dirs(args.trees):
        data = load_labels(args.labels / f"{tree.name}.json")
        print(f"{data['repo']} @ {data['commit']}")
    rows, todo, stale = measure(args.trees, args.labels, args.stub)
    print(table(rows, args.markdown))
    for line in todo:
        print("not labelled:", line)
    for line in stale:
        print("label without a finding:", line)


if __name__ == "__main__":
    main()
