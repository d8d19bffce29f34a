"""Run output: ``metrics.jsonl`` rows and progress for a person (a bar on a TTY, plain lines otherwise)."""

from __future__ import annotations

import json
import math
import sys
import time
import weakref
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from torchkeel.io import write_text_atomic


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl``.

    Rows are written out at least every ``flush_every_s`` seconds (0: every row), at ``flush()``,
    at ``close()`` and when the writer is collected or the interpreter exits: a killed run loses
    at most that last second of rows, and a run with millisecond steps does not pay for
    serializing and a system call at every logged row. Non-finite floats are written as
    ``null`` (JSON has no NaN).
    """

    def __init__(self, path: str | Path, flush_every_s: float = 1.0) -> None:
        self.path = Path(path)
        self.flush_every_s = flush_every_s
        self._file: TextIO = open(self.path, "a", encoding="utf-8")
        self._pending: list[dict[str, Any]] = []
        self._flushed = time.monotonic()
        self._at_exit = weakref.finalize(self, _write_rows, self._file, self._pending)

    def write(self, row: dict[str, Any]) -> None:
        self._pending.append(dict(row))  # a copy: the caller's loggers may add to theirs
        if time.monotonic() - self._flushed >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Every row written so far on disk (before a checkpoint, so a resume finds them)."""
        _write_rows(self._file, self._pending)
        self._flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._at_exit.detach()
        self._file.close()


def _write_rows(file: TextIO, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` out as lines (emptying the list) and flush ``file``."""
    lines = [json.dumps({k: _finite_or_none(v) for k, v in row.items()}) + "\n" for row in rows]
    rows.clear()
    file.write("".join(lines))
    file.flush()


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` file; a half-written last line (killed run) is ignored."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def drop_rows_after(path: Path, step: int) -> None:
    """Drop the rows of a JSON-lines file (``metrics.jsonl``, ``incidents.jsonl``) written after
    ``step`` (by a run that was killed later).

    The resumed run writes them again, so the file reads as one uninterrupted run.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if row.get("step", 0) <= step:
            kept.append(line + "\n")
    write_text_atomic(path, "".join(kept))


def train_row(
    result: Any,
    counters: Any,
    lr: float,
    rates: dict[str, float],
    scores: Any = None,
    clip_frac: float | None = None,
) -> dict[str, Any]:
    """The ``metrics.jsonl`` row of a logged step (a ``StepResult``; ``counters``: a ``RunCounters``).
    Reads the loss on the host when the guard did not, and computes ``scores`` (a ``MetricSet``:
    on every rank at the same steps, since torchmetrics syncs here). ``clip_frac``: the share of
    the window's steps that clipping rescaled (``ClipRate.window_frac``; ``None``: not clipping)."""
    loss, grad_norm = result.loss_value, result.grad_norm_value
    if loss is None:  # the guard is off: read them now (host sync, log steps only)
        loss, grad_norm = result.loss.item(), result.grad_norm.item()
    metrics = {k: v.item() for k, v in (result.metrics or {}).items()}  # host sync, log steps only
    if scores is not None:
        metrics.update(scores.compute())
    return {
        "kind": "train",
        "step": counters.step,
        "epoch": counters.epoch,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        **({"clip_frac": clip_frac} if clip_frac is not None else {}),
        "samples": counters.samples,
        **rates,
        **metrics,
    }


class Throughput:
    """Samples (and tokens, for token batches) per second since the last ``rates()`` (the window
    of one log row), from the run's running counts (nothing to add per step)."""

    def __init__(self, counters: Any) -> None:
        self.samples, self.tokens, self.start = counters.samples, counters.tokens, time.perf_counter()

    def rates(self, counters: Any) -> dict[str, float]:
        """``samples_per_s``, and ``tokens_per_s`` once the run has counted tokens."""
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        rates = {"samples_per_s": (counters.samples - self.samples) / elapsed}
        if counters.tokens:
            rates["tokens_per_s"] = (counters.tokens - self.tokens) / elapsed
        self.samples, self.tokens, self.start = counters.samples, counters.tokens, now
        return rates


class Progress:
    """Shows training progress: a tqdm bar when ``stream`` is a TTY, one line per logged step otherwise.

    ``initial``: the step a resumed run starts at (the bar counts from there).
    """

    def __init__(
        self, total_steps: int, *, enabled: bool = True, stream: TextIO | None = None, initial: int = 0
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.is_tty = enabled and self.stream.isatty()
        self.bar = (
            tqdm(total=total_steps, initial=initial, file=self.stream, unit="step", dynamic_ncols=True)
            if self.is_tty
            else None
        )
        self.total_steps = total_steps

    def advance(self, steps: int) -> None:
        """Mark ``steps`` more optimizer steps done (bar only)."""
        if self.bar is not None:
            self.bar.update(steps)

    def log(self, row: dict[str, Any]) -> None:
        """Show a metrics row: bar postfix on a TTY, a plain line otherwise."""
        if not self.enabled or row.get("kind") in _FILE_ONLY:
            return
        text = " ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k not in ("kind", "wall_s"))
        prefix = _PREFIXES.get(row.get("kind"), "")
        if self.bar is not None and not prefix:
            self.bar.set_postfix_str(text, refresh=False)
        elif self.bar is not None:
            self.bar.write(f"{prefix}{text}", file=self.stream)
        else:
            print(f"{prefix}{text}", file=self.stream, flush=True)

    def note(self, message: str) -> None:
        """A line of information for a person (progress output on)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(f"keel: {message}", file=self.stream)
        else:
            print(f"keel: {message}", file=self.stream, flush=True)

    def say(self, message: str) -> None:
        """A line a person must see (a resume, what it changed): shown even when progress output is off."""
        if self.bar is not None:
            self.bar.write(f"keel: {message}", file=self.stream)
        else:
            print(f"keel: {message}", file=self.stream, flush=True)

    def warn(self, message: str) -> None:
        """A warning for a person; shown even when progress output is off."""
        if self.bar is not None:
            self.bar.write(f"keel: warning: {message}", file=self.stream)
        else:
            print(f"keel: warning: {message}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# Rows for the file and the report only (the worker trial, the job, a resume and the clipping
# warning have lines of their own).
_FILE_ONLY = ("memory", "data_workers", "dist", "resume", "clipping", "param_groups")
# Rows other than training steps get a line of their own, with a prefix.
_PREFIXES = {"val": "validation: "}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
