"""The language-model journey's data, as users have it: a folder of ``.txt`` files (the standard
library's documentation, from ``examples/text/corpus.py``) and a ``.jsonl`` file of documents,
with a line that is not UTF-8 and a line that is not JSON among them."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("json", "csv", "heapq", "bisect", "string", "textwrap")
BYTES_PER_FILE = 6000


def write(root: Path) -> tuple[Path, list[str]]:
    """``root/train`` and ``root/val``; returns the train folder and its bad lines (``file line N``)."""
    sys.path.insert(0, str(ROOT / "examples" / "text"))
    try:
        import corpus
    finally:
        sys.path.pop(0)
    train, val = root / "train", root / "val"
    train.mkdir(parents=True)
    val.mkdir(parents=True)
    texts = [_cut(corpus.documentation(name)) for name in MODULES]
    for name, text in zip(MODULES[:-1], texts):
        (train / f"{name}.txt").write_text(text, encoding="utf-8")
    (val / f"{MODULES[-1]}.txt").write_text(texts[-1], encoding="utf-8")
    lines = texts[0].splitlines(keepends=True)
    broken = "".join(lines[:10]).encode() + b"caf\xe9 au lait\n" + "".join(lines[10:]).encode()
    (train / "latin1.txt").write_bytes(broken)
    documents = [
        json.dumps({"text": line.strip(), "id": i}) for i, line in enumerate(texts[1].splitlines()) if line.strip()
    ]
    documents.insert(4, '{"text": "an unfinished line')
    (train / "docs.jsonl").write_text("\n".join(documents) + "\n", encoding="utf-8")
    bad = [f"{train / 'latin1.txt'} line 11", f"{train / 'docs.jsonl'} line 5"]
    return train, bad


def _cut(text: str) -> str:
    """The first ``BYTES_PER_FILE`` bytes or so of ``text``, at a line end."""
    return text[: text.index("\n", BYTES_PER_FILE) + 1] if len(text) > BYTES_PER_FILE else text


def throttle(batch: Any) -> Any:
    """A ``data.batch_transform`` that waits ``$JOURNEY_DELAY`` seconds per block of rows, so
    that a kill can land mid-epoch."""
    delay = float(os.environ.get("JOURNEY_DELAY", "0"))
    if delay:
        time.sleep(delay)
    return batch
