"""``incidents.jsonl``: every protection that acted (non-finite step, rollback, OOM split, leak,
loss spike, memory warning) leaves one row, and a count for ``summary.json``."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any


class IncidentLog:
    """Appends incidents to ``path`` (flushed per row; ``None``: count only, as on ranks other than 0)."""

    def __init__(self, path: str | Path | None, counts: dict[str, int] | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.counts: Counter[str] = Counter(counts or {})

    def record(self, kind: str, step: int, message: str, **details: Any) -> dict[str, Any]:
        """Write ``{"kind", "step", "message", "time", **details}`` and count it; returns the row."""
        row = {"kind": kind, "step": step, "message": message, "time": round(time.time(), 3), **details}
        self.counts[kind] += 1
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row, default=str) + "\n")
        return row

    def summary_line(self, distinct: dict[str, int] | None = None) -> str | None:
        """``incidents: 3 nonfinite, 1 rollback`` or ``None`` when nothing happened; ``distinct``
        adds, for a kind met again and again (a bad sample in every epoch), how many different
        ones there were: ``6 bad_sample (3 distinct, each printed once)``."""
        if not self.counts:
            return None
        distinct = distinct or {}

        def part(kind: str, n: int) -> str:
            d = distinct.get(kind)
            return f"{n} {kind}" + (f" ({d} distinct, each printed once)" if d is not None and d < n else "")

        return "incidents: " + ", ".join(part(kind, n) for kind, n in sorted(self.counts.items()))
