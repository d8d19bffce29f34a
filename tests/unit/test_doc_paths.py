"""Where the docs say a name lives, it lives: every ``from torchkeel... import`` line, every
backticked ``torchkeel.<module>...`` path, every ``tk.<name>``, and the tables a doc introduces
with "The code lives in `torchkeel.<package>`" (a cell may name its own module first)."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import torchkeel

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
SUBMODULES = {m.name for m in pkgutil.iter_modules(torchkeel.__path__)}
IMPORT = re.compile(r"^\s*from (torchkeel[\w.]*) import (\([^)]*\)|[^\n#]+)", re.M)
DOTTED = re.compile(r"`(torchkeel\.(\w+)(?:\.\w+)*)")
SHORT = re.compile(r"\btk\.([A-Za-z_]\w*)")
# "lives in `M`", the rest of its paragraph, then a table.
LIVES = re.compile(r"lives in `(torchkeel[\w.]*)`(?:[^\n]|\n(?!\n))*\n\n((?:\|[^\n]*\n)+)")


def placed(text: str) -> list[str]:
    """The dotted path of every name ``text`` places in a module of torchkeel."""
    found = [f"{m[1]}.{name}" for m in IMPORT.finditer(text) for name in re.findall(r"\w+", m[2])]
    found += [m[1] for m in DOTTED.finditer(text) if m[2] in SUBMODULES]  # not a tag like `torchkeel.incidents`
    found += [f"torchkeel.{m[1]}" for m in SHORT.finditer(text)]
    for m in LIVES.finditer(text):
        for row in m[2].splitlines()[2:]:  # past the header and its rule
            module = m[1]
            for name in re.findall(r"`([\w.]+)`", row.split("|")[1]):
                if name.startswith("torchkeel."):
                    module = name
                else:
                    found.append(f"{module}.{name}")
    return found


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(target, attr):
                return False
            target = getattr(target, attr)
        return True
    return False


def test_every_import_path_the_docs_give_resolves():
    missing = [f"{doc.name}: {path}" for doc in DOCS for path in placed(doc.read_text()) if not resolves(path)]
    assert missing == []


def test_the_checker_reads_what_the_docs_write():
    text = (
        "from torchkeel.checkpoint.sharded import read_full_weights\n"
        "`torchkeel.train.profiling.StepProfiler`, `torchkeel.incidents` (a tag), tk.Trainer\n"
        "The code lives in `torchkeel.distributed` (a paragraph\nof two lines):\n\n| component | job |\n|---|---|\n"
        "| `JobGroup` | x |\n| `torchkeel.checkpoint.sharded`: `save_sharded` | y |\n"
    )
    assert placed(text) == [
        "torchkeel.checkpoint.sharded.read_full_weights",
        "torchkeel.train.profiling.StepProfiler",
        "torchkeel.distributed",
        "torchkeel.checkpoint.sharded",
        "torchkeel.Trainer",
        "torchkeel.distributed.JobGroup",
        "torchkeel.checkpoint.sharded.save_sharded",
    ]
    assert not resolves("torchkeel.distributed.read_full_weights") and resolves("torchkeel.distributed.JobGroup")
