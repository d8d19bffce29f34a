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

    def summary_line(self) -> str | None:
        """``incidents: 3 nonfinite, 1 rollback`` or ``None`` when nothing happened."""
        if not self.counts:
            return None
        return "incidents: " + ", ".join(f"{n} {kind}" for kind, n in sorted(self.counts.items()))
