"""A text folder to train on, made from what every Python install has: the documentation of its
standard library, one ``.txt`` file per module (English prose and code, about 1 MB).

    python examples/text/corpus.py data/            # writes data/text/{train,val}/*.txt
    keel train examples/text/gpt2-bytes.yaml

Every tenth module's text goes to ``val``, the rest to ``train``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pydoc
import sys
import warnings
from pathlib import Path

MODULES = sorted(set(sys.stdlib_module_names) - {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"})


def write(root: Path, limit: int | None = None) -> Path:
    """``root/text/{train,val}/<module>.txt`` for the first ``limit`` modules that import here."""
    out = root / "text"
    written = 0
    for name in MODULES:
        if limit is not None and written >= limit:
            break
        text = documentation(name)
        if not text:
            continue
        split = "val" if written % 10 == 9 else "train"
        (out / split).mkdir(parents=True, exist_ok=True)
        (out / split / f"{name}.txt").write_text(text, encoding="utf-8")
        written += 1
    return out


def documentation(name: str) -> str:
    """The module's help page as plain text, or nothing when it does not import here."""
    if name.startswith("_"):
        return ""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
            return pydoc.plaintext.document(module)
    except Exception:  # a module of another platform, or one that needs a display
        return ""


if __name__ == "__main__":
    print(write(Path(sys.argv[1] if len(sys.argv) > 1 else "data")))
