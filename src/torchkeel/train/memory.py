"""Memory monitoring and leak detection, usable from any loop.

``MemoryMonitor.sample()`` returns the figures (process RSS; on CUDA allocated, reserved,
peak allocated, fragmentation) and the warnings they deserve. ``LeakDetector.observe(step)``
takes a census now and then — CUDA allocated bytes, or on the CPU a gc census of live tensors
and of the autograd graphs they hold — and reports memory that grows census after census,
with its rate and the groups of tensors that grew. The classic ``total_loss += loss`` keeps
every step's graph alive: the graph census grows by one step's graph per step.
"""

from __future__ import annotations

import gc
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchkeel.config.schema import MemoryConfig
from torchkeel.introspect.graph import graph_nodes
from torchkeel.introspect.memory import rss_bytes


class MemoryReader(Protocol):
    """Where the figures come from; tests pass a fake to play a CUDA machine on a CPU."""

    def rss_bytes(self) -> int: ...
    def cuda(self, device: torch.device) -> dict[str, int] | None: ...


class SystemReader:
    """The real figures: /proc for RSS, ``torch.cuda`` memory statistics on CUDA devices."""

    def rss_bytes(self) -> int:
        return rss_bytes()

    def cuda(self, device: torch.device) -> dict[str, int] | None:
        if device.type != "cuda":
            return None
        return {
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "total": torch.cuda.get_device_properties(device).total_memory,
        }


@dataclass
class MemoryStats:
    rss_bytes: int
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None
    cuda_peak_allocated_bytes: int | None = None
    cuda_total_bytes: int | None = None

    @property
    def fragmentation(self) -> float | None:
        """1 − allocated/reserved: memory the caching allocator holds but no tensor uses."""
        if not self.cuda_reserved_bytes:
            return None
        return 1.0 - (self.cuda_allocated_bytes or 0) / self.cuda_reserved_bytes

    def row(self) -> dict[str, Any]:
        """The metrics.jsonl fields (``None`` ones left out)."""
        values = {
            "rss_bytes": self.rss_bytes,
            "cuda_allocated_bytes": self.cuda_allocated_bytes,
            "cuda_reserved_bytes": self.cuda_reserved_bytes,
            "cuda_peak_allocated_bytes": self.cuda_peak_allocated_bytes,
            "fragmentation": None if self.fragmentation is None else round(self.fragmentation, 4),
        }
        return {k: v for k, v in values.items() if v is not None}


class MemoryMonitor:
    """Samples memory figures and says when they cross the configured thresholds."""

    def __init__(
        self,
        device: torch.device,
        *,
        warn_rss_gb: float | None = None,
        warn_cuda_fraction: float = 0.9,
        reader: MemoryReader | None = None,
    ) -> None:
        self.device = device
        self.warn_rss_gb = warn_rss_gb
        self.warn_cuda_fraction = warn_cuda_fraction
        self.reader = reader or SystemReader()
        self._above: set[str] = set()  # thresholds crossed and not yet gone back below

    @classmethod
    def from_config(
        cls, memory: MemoryConfig, device: torch.device, reader: MemoryReader | None = None
    ) -> MemoryMonitor:
        """The monitor the config's ``memory`` section describes."""
        return cls(device, warn_rss_gb=memory.warn_rss_gb, warn_cuda_fraction=memory.warn_cuda_fraction, reader=reader)

    def sample(self) -> tuple[MemoryStats, list[str]]:
        """Current figures, and one warning line per threshold crossed since the last sample.

        A threshold warns once when crossed, and again only after the figure went back below it.
        """
        cuda = self.reader.cuda(self.device)
        stats = MemoryStats(self.reader.rss_bytes())
        if cuda is not None:
            stats = MemoryStats(
                stats.rss_bytes, cuda["allocated"], cuda["reserved"], cuda["peak_allocated"], cuda["total"]
            )
        crossed: dict[str, str] = {}
        if self.warn_rss_gb is not None and stats.rss_bytes > self.warn_rss_gb * 2**30:
            crossed["rss"] = (
                f"process RSS {stats.rss_bytes / 2**30:.2f} GiB is above memory.warn_rss_gb={self.warn_rss_gb}"
            )
        if stats.cuda_total_bytes and stats.cuda_reserved_bytes is not None:
            fraction = stats.cuda_reserved_bytes / stats.cuda_total_bytes
            if fraction > self.warn_cuda_fraction:
                frag = stats.fragmentation or 0.0
                crossed["cuda"] = (
                    f"CUDA reserved memory is {fraction:.0%} of the device (fragmentation {frag:.0%}); "
                    + (
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation"
                        if frag > 0.3
                        else "a larger batch may run out of memory"
                    )
                )
        warnings = [text for key, text in crossed.items() if key not in self._above]
        self._above = set(crossed)
        return stats, warnings


@dataclass
class Census:
    """Live tensors by group, and the autograd graph nodes they keep alive."""

    step: int
    num_tensors: int
    tensor_bytes: int
    graph_nodes: int
    groups: Counter = field(default_factory=Counter)
    group_bytes: Counter = field(default_factory=Counter)
    cuda_allocated_bytes: int | None = None


def tensor_census(step: int, cuda_allocated_bytes: int | None = None) -> Census:
    """Walk every Python-visible tensor; group by (shape, dtype, device, holds a graph)."""
    groups: Counter = Counter()
    group_bytes: Counter = Counter()
    roots = []
    num = total = 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # not isinstance: it trips over dead weak proxies
            continue
        try:
            key = (tuple(int(d) for d in obj.shape), str(obj.dtype), str(obj.device), obj.grad_fn is not None)
            size = int(obj.numel()) * obj.element_size()
        except Exception:  # noqa: BLE001 - exotic subclasses (fake or meta tensors) are skipped
            continue
        num += 1
        total += size
        groups[key] += 1
        group_bytes[key] += size
        if obj.grad_fn is not None:
            roots.append(obj.grad_fn)
    return Census(step, num, total, len(graph_nodes(roots)), groups, group_bytes, cuda_allocated_bytes)


class LeakDetector:
    """Reports memory that grows over ``window`` censuses in a row, after ``warmup_steps``.

    A CPU census walks every object the garbage collector tracks (tens to hundreds of
    milliseconds in a large process), so it is spent where it pays:

    - a cheap signal is read every ``signal_every_steps`` steps (0: never), at most once per
      ``signal_min_s`` seconds — process RSS, or CUDA allocated bytes on CUDA (microseconds).
      When its maximum rises by more than ``min_growth_bytes`` in
      each of ``rising_windows`` windows of ``window_s`` seconds, a leak is suspected and
      censuses come as often as ``suspect_overhead`` of the time allows, until 3 of them in a row
      confirm it (the cheap signal counts as the rest of the ``window``) — or one refutes it: the
      suspicion is dropped and the windows double in length;
    - without suspicion, a census comes only when its cost is at most ``max_overhead`` of the
      time since the last one (the first assumes ``first_cost_s``: with the defaults, 20 s into
      training), which catches leaks that do not show in the cheap signal.

    A kept step output on the CPU is reported within about 20 s of training. On CUDA the census
    signal is allocated bytes; on the CPU, live tensors and autograd graph nodes. Each leak is
    reported once.
    """

    def __init__(
        self,
        *,
        every_steps: int = 200,
        warmup_steps: int = 20,
        window: int = 4,
        max_overhead: float = 0.01,
        first_cost_s: float = 0.2,
        signal_every_steps: int = 10,
        signal_min_s: float = 0.05,
        window_s: float = 2.0,
        rising_windows: int = 3,
        min_growth_bytes: int = 256 * 2**10,
        suspect_overhead: float = 0.1,
        device: torch.device | None = None,
        reader: MemoryReader | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.every_steps = every_steps
        self.window = window
        self.max_overhead = max_overhead
        self.signal_every_steps, self.signal_min_s = signal_every_steps, signal_min_s
        self.window_s = window_s
        self.rising_windows = rising_windows
        self.min_growth_bytes = min_growth_bytes
        self.suspect_overhead = suspect_overhead
        self.device = device or torch.device("cpu")
        self.reader = reader or SystemReader()
        self.clock = clock
        self.history: list[Census] = []
        self.reported = False
        self.suspected_at_step: int | None = None
        self._warmup_steps = warmup_steps
        self._next_step = warmup_steps
        self._cost = first_cost_s
        self._last_end = self._started = clock()
        self._window_start: float | None = None
        self._signal_at = -math.inf
        self._window_max = 0
        self._window_maxes: list[int] = []

    @classmethod
    def from_config(
        cls, memory: MemoryConfig, device: torch.device, reader: MemoryReader | None = None
    ) -> LeakDetector | None:
        """The detector the config's ``memory`` section describes (``None``: ``leak_check`` off)."""
        if not memory.leak_check:
            return None
        return cls(
            every_steps=memory.leak_every_steps,
            warmup_steps=memory.leak_warmup_steps,
            window=memory.leak_window,
            max_overhead=memory.leak_max_overhead,
            device=device,
            reader=reader,
        )

    def observe(self, step: int) -> dict[str, Any] | None:
        """Call once per step; returns a finding (plain data) the first time growth is sustained."""
        if self.reported or step < self._warmup_steps:
            return None
        signal_step = self.signal_every_steps and step % self.signal_every_steps == 0
        if not signal_step and self.suspected_at_step is None and step < self._next_step:
            return None  # most steps: nothing is due, not even a look at the clock
        start = self.clock()
        if signal_step and start - self._signal_at >= self.signal_min_s:
            self._signal_at = start
            self._watch(start, step)
        elapsed = start - self._last_end
        if self.suspected_at_step is not None:
            if self._cost > self.suspect_overhead * elapsed:
                return None
        elif step < self._next_step or self._cost > self.max_overhead * elapsed:
            return None  # not yet: the census would cost more than its share of the time
        cuda = self.reader.cuda(self.device)
        self.history = (self.history + [tensor_census(step, cuda["allocated"] if cuda else None)])[-self.window :]
        self._last_end = self.clock()
        self._cost = self._last_end - start
        self._next_step = step + self.every_steps
        finding = self._finding()
        if finding is None and self.suspected_at_step is not None and len(self.history) >= 2 and not self._grew():
            self._drop_suspicion()
        return finding

    def _watch(self, now: float, step: int) -> None:
        """Feed the cheap signal into windows of ``window_s``; suspect a leak if it keeps rising."""
        cuda = self.reader.cuda(self.device)
        value = cuda["allocated"] if cuda else self.reader.rss_bytes()
        if self._window_start is None or now - self._window_start >= self.window_s:
            if self._window_start is not None:
                self._window_maxes = (self._window_maxes + [self._window_max])[-(self.rising_windows + 1) :]
            self._window_start, self._window_max = now, value
            maxes = self._window_maxes
            rising = len(maxes) > self.rising_windows and all(
                b - a > self.min_growth_bytes for a, b in zip(maxes, maxes[1:])
            )
            if rising and self.suspected_at_step is None:
                self.suspected_at_step = step
        else:
            self._window_max = max(self._window_max, value)

    def _grew(self) -> bool:
        a, b = self.history[-2], self.history[-1]
        if a.cuda_allocated_bytes is not None:
            return a.cuda_allocated_bytes < b.cuda_allocated_bytes
        return a.graph_nodes < b.graph_nodes or a.num_tensors < b.num_tensors

    def _drop_suspicion(self) -> None:
        self.suspected_at_step = None
        self._window_maxes = []
        self.window_s *= 2  # a signal that rises without a leak behind it: look less often

    def _finding(self) -> dict[str, Any] | None:
        needed = self.window if self.suspected_at_step is None else min(self.window, 3)
        if len(self.history) < needed:
            return None
        self.history = self.history[-needed:]
        first, last = self.history[0], self.history[-1]
        on_cuda = first.cuda_allocated_bytes is not None
        signals = ["cuda_allocated_bytes"] if on_cuda else ["graph_nodes", "num_tensors"]
        growing = [
            s for s in signals if all(getattr(a, s) < getattr(b, s) for a, b in zip(self.history, self.history[1:]))
        ]
        if not growing:
            return None
        self.reported = True
        steps = max(last.step - first.step, 1)
        grown = (last.groups - first.groups).most_common(5)
        added_bytes = (
            last.cuda_allocated_bytes - first.cuda_allocated_bytes
            if on_cuda
            else last.tensor_bytes - first.tensor_bytes
        )
        return {
            "signal": growing[0],
            "steps": [first.step, last.step],
            "suspected_at_step": self.suspected_at_step,
            "elapsed_s": self.clock() - self._started,
            "graph_nodes_per_step": (last.graph_nodes - first.graph_nodes) / steps,
            "tensors_per_step": (last.num_tensors - first.num_tensors) / steps,
            "bytes_per_step": added_bytes / steps,
            "top_groups": [
                {
                    "shape": list(k[0]),
                    "dtype": k[1],
                    "device": k[2],
                    "holds_graph": k[3],
                    "added": n,
                    "added_bytes": last.group_bytes[k] - first.group_bytes[k],
                }
                for k, n in grown
            ],
        }
