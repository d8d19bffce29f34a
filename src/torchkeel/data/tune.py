"""``num_workers: auto``: a short timed trial of worker counts on the real data picks the fastest.

Each candidate (0, 1, 2, … up to the CPUs this process may use) loads batches for a short
while after its workers are up; the fewest workers within ``TOLERANCE`` of the best wins (more
workers cost memory and CPU the training step could use). The choice is cached per data
fingerprint and machine, so the next run starts at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchkeel.batch import num_samples
from torchkeel.introspect.memory import rss_bytes
from torchkeel.io import write_json_atomic

TOLERANCE = 0.95
"""A candidate within this share of the best throughput counts as fast as the best."""


@dataclass
class Trial:
    num_workers: int
    samples_per_s: float
    rss_bytes: int
    """Resident memory of the main process and its workers while loading."""
    startup_s: float
    """Time to the first batch (worker start), not part of the throughput."""


@dataclass
class TuneResult:
    num_workers: int
    reason: str
    trials: list[Trial] = field(default_factory=list)
    cached: bool = False

    def row(self) -> dict[str, Any]:
        """A ``metrics.jsonl`` row."""
        return {
            "kind": "data_workers",
            "num_workers": self.num_workers,
            "reason": self.reason,
            "cached": self.cached,
            "trials": [asdict(t) for t in self.trials],
        }

    def table(self) -> str:
        """The trial as a table for a person (``keel data-bench``)."""
        best = max((t.samples_per_s for t in self.trials), default=0.0) or 1.0
        lines = [f"{'workers':>7}  {'samples/s':>11}  {'RSS MiB':>8}  {'startup s':>9}  {'vs best':>7}"]
        for t in self.trials:
            mark = "  <- chosen" if t.num_workers == self.num_workers else ""
            lines.append(
                f"{t.num_workers:>7}  {t.samples_per_s:>11.1f}  {t.rss_bytes / 2**20:>8.0f}  "
                f"{t.startup_s:>9.2f}  {t.samples_per_s / best:>6.2f}x{mark}"
            )
        return "\n".join(lines)


def candidates(limit: int | None = None, least: int = 0) -> list[int]:
    """``least``, ``least`` + 1, … up to the CPUs this process may use (``limit`` caps it)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return list(range(least, max(least, min(usable, limit if limit is not None else usable)) + 1))


def tune_workers(
    make_loader: Callable[[int], Any],
    *,
    fingerprint: str,
    cache_dir: str | Path | None = None,
    trial_s: float = 0.6,
    limit: int | None = None,
    least: int = 0,
    use_cache: bool = True,
) -> TuneResult:
    """Pick the worker count for the loader ``make_loader(num_workers)`` builds.

    Args:
        make_loader: builds a loader (``EpochLoader``/``StreamLoader``) with that many workers.
        fingerprint: identifies the data and batch settings; with the machine, the cache key.
        cache_dir: where the choice is kept (default ``$XDG_CACHE_HOME/torchkeel``).
        trial_s: seconds of loading per candidate, after its first batch.
        limit: the most workers tried; ``least``: the fewest (1 for data whose reading should
            never run in the training process, as tokenizing text).
    """
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(json.dumps([fingerprint, machine(), least]).encode()).hexdigest()[:32]
    cache = _read_cache(path / "num_workers.json")
    if use_cache and key in cache:
        hit = cache[key]
        return TuneResult(
            int(hit["num_workers"]),
            f"cached trial: {hit['reason']}",
            [Trial(**t) for t in hit.get("trials", [])],
            cached=True,
        )
    trials = [_trial(make_loader, n, trial_s) for n in candidates(limit, least)]
    result = choose(trials)
    if max(t.samples_per_s for t in trials) == 0:
        return result  # nothing loaded: training will report why; not cached
    cache[key] = {
        "num_workers": result.num_workers,
        "reason": result.reason,
        "trials": [asdict(t) for t in trials],
        "fingerprint": fingerprint[:500],
        "at": time.time(),
    }
    try:
        path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path / "num_workers.json", cache)
    except OSError:
        pass  # a read-only home: the trial simply runs again next time
    return result


def choose(trials: list[Trial]) -> TuneResult:
    """The fewest workers within ``TOLERANCE`` of the best throughput, and why (pure: the
    figures decide, so that the rule is tested apart from any timing)."""
    best = max(trials, key=lambda t: t.samples_per_s)
    if best.samples_per_s == 0:
        return TuneResult(0, "no batch loaded in the trial (the data fails to load); 0 workers", trials)
    chosen = next(t for t in trials if t.samples_per_s >= TOLERANCE * best.samples_per_s)
    reason = (
        f"{chosen.samples_per_s:.0f} samples/s with {chosen.num_workers} workers"
        + (
            f", within {1 - TOLERANCE:.0%} of the best ({best.num_workers} workers, {best.samples_per_s:.0f}/s)"
            if chosen is not best
            else f", the fastest of {len(trials)} candidates"
        )
        + (f"; 0 workers: {trials[0].samples_per_s:.0f}/s" if chosen.num_workers and not trials[0].num_workers else "")
    )
    return TuneResult(chosen.num_workers, reason, trials)


def _trial(make_loader: Callable[[int], Any], num_workers: int, trial_s: float) -> Trial:
    loader = make_loader(num_workers)
    batches: Iterator[Any] = loader.epoch(0)
    start = time.perf_counter()
    samples, rss = 0, 0
    try:
        first = next(batches, None)
        startup = time.perf_counter() - start
        begin = time.perf_counter()
        count = 0
        if first is not None:
            for batch in batches:  # a DataError (too many bad samples) ends the trial: see below
                samples += num_samples(batch)
                count += 1
                if count % 4 == 0 and time.perf_counter() - begin >= trial_s:
                    break
            rss = _rss_with_workers()
        elapsed = max(time.perf_counter() - begin, 1e-9)
    except Exception:  # noqa: BLE001 - bad data: training reads it again and names what is wrong
        samples, elapsed, startup = 0, 1.0, time.perf_counter() - start
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        getattr(loader, "close", lambda: None)()
    return Trial(num_workers, samples / elapsed if samples else 0.0, rss, round(startup, 4))


def _rss_with_workers() -> int:
    """Resident memory of this process and its children (the loader's workers)."""
    import multiprocessing

    total = rss_bytes()
    for pid in (child.pid for child in multiprocessing.active_children()):
        try:
            with open(f"/proc/{pid}/statm", "rb") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
    return total


def machine() -> list[Any]:
    """What makes a timing of this machine comparable: host, CPUs, torch build."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [platform.node(), os.cpu_count(), usable, torch.__version__]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchkeel"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
