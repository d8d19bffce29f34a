"""``profile: {steps: [start, end]}``: a ``torch.profiler`` trace of those training steps, and where
their time went.

Each rank writes ``<run_dir>/profile/rank<r>.<timestamp>.pt.trace.json``: Chrome trace JSON that
Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open, in the layout TensorBoard's profiler
plugin reads (``tensorboard --logdir <run_dir>/profile``). Rank 0 also writes ``summary.json``:
the top operators by self time, and the step's time split into forward, backward, optimizer and
the rest (data loading and host code), with the host syncs (``.item()``) counted. Nothing runs
outside the window: the forward is timed by hooks put on the model only for those steps.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from torchkeel.config.schema import ProfileConfig
from torchkeel.io import write_json_atomic

TOP = 15
"""Operators listed in ``summary.json`` and the report."""
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""A host sync in the trace: the CPU waits for the GPU (a value read with ``.item()``, ``bool(t)``...).
On the CPU there is nothing to wait for: none are counted."""
STEP = "ProfilerStep"  # ProfilerStep#N, or ProfilerStep* in the events of a finished profile
BACKWARD = "autograd::engine::evaluate_function"
OPTIMIZER = ("Optimizer.step#", "Optimizer.zero_grad#")
FORWARD = "forward"


class StepProfiler:
    """Profiles training steps ``cfg.steps[0]`` to ``cfg.steps[1]`` (counted from 1, both included).

    Call ``before_step(n)`` before step ``n`` and ``close()`` when training ends (it finishes a
    window the run did not reach the end of). Usable from a hand-written loop; ``say`` gets the
    one-line summary on rank 0 (printed to stderr by default).
    """

    def __init__(
        self,
        cfg: ProfileConfig,
        out_dir: str | Path,
        model: torch.nn.Module,
        rank: int = 0,
        say: Callable[[str], None] = lambda line: print(f"keel: {line}", file=sys.stderr, flush=True),
    ) -> None:
        self.start, self.end = (cfg.steps[0], cfg.steps[1]) if cfg.steps else (0, -1)
        self.cfg, self.out_dir, self.model, self.rank, self.say = cfg, Path(out_dir), model, rank, say
        self._profile: profile | None = None
        self._hooks: list[Any] = []
        self.summary: dict[str, Any] | None = None

    def before_step(self, step: int) -> None:
        if self._profile is None:
            if step == self.start:
                self._begin()
            return
        if step > self.end:
            self.close()
        else:
            self._profile.step()

    def close(self) -> None:
        """Stop a profile in progress; write its trace and, on rank 0, its summary."""
        if self._profile is None:
            return
        held, self._profile = self._profile, None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        held.stop()  # writes the trace (on_trace_ready)
        self.summary = summarize(held.events(), steps=[self.start, min(self.end, self.start + held.step_num)])
        if self.rank == 0:
            write_json_atomic(self.out_dir / "summary.json", self.summary)
            self.say(f"{describe(self.summary)}; trace in {self.out_dir}")

    def _begin(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # "won't be using warmup": the window is what was asked for
            warnings.filterwarnings("ignore", message=".*warmup.*")
            self._profile = self._new_profile(activities)
        labels: list[Any] = []

        def enter(module: torch.nn.Module, args: Any) -> None:
            labels.append(record_function(FORWARD).__enter__())

        def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
            if labels:
                labels.pop().__exit__(None, None, None)

        self._hooks = [self.model.register_forward_pre_hook(enter), self.model.register_forward_hook(leave)]
        self._profile.start()

    def _new_profile(self, activities: list[ProfilerActivity]) -> profile:
        return profile(
            activities=activities,
            # With a schedule the profiler marks each step (ProfilerStep#N); the trace is written at close().
            schedule=schedule(wait=0, warmup=0, active=self.end - self.start + 1, repeat=1),
            record_shapes=self.cfg.record_shapes,
            profile_memory=self.cfg.memory,
            with_stack=False,
            on_trace_ready=tensorboard_trace_handler(str(self.out_dir), worker_name=f"rank{self.rank}"),
        )


def summarize(events: Iterable[Any], steps: list[int]) -> dict[str, Any]:
    """The profile's figures from its events: top operators by self time, the step's time split,
    host syncs. Times in milliseconds per step."""
    events = list(events)
    step_events = [e for e in events if e.name.startswith(STEP)]
    count = max(len(step_events), 1)
    total = sum(_ms(e.time_range) for e in step_events) if step_events else _span(events)

    def outermost(match: Any) -> float:
        chosen = [e for e in events if match(e.name)]
        inside = {id(c) for e in chosen for c in _descendants(e)}
        return sum(_ms(e.time_range) for e in chosen if id(e) not in inside)

    parts = {
        "forward": outermost(lambda name: name == FORWARD),
        "backward": outermost(lambda name: name.startswith(BACKWARD)),
        "optimizer": outermost(lambda name: name.startswith(OPTIMIZER)),
    }
    parts["other"] = max(total - sum(parts.values()), 0.0)
    syncs = [e for e in events if e.name in SYNCS]
    by_name: dict[str, dict[str, float]] = {}
    for e in events:
        if e.name.startswith((STEP, BACKWARD, *OPTIMIZER)) or e.name == FORWARD:
            continue
        row = by_name.setdefault(e.name, {"calls": 0, "self_ms": 0.0, "total_ms": 0.0, "device_ms": 0.0})
        row["calls"] += 1
        row["self_ms"] += e.self_cpu_time_total / 1e3
        row["total_ms"] += _ms(e.time_range)
        row["device_ms"] += getattr(e, "self_device_time_total", 0.0) / 1e3
    top = sorted(by_name.items(), key=lambda item: -item[1]["self_ms"])[:TOP]
    return {
        "steps": steps,
        "step_ms": total / count,
        "split_ms": {name: value / count for name, value in parts.items()},
        "host_syncs_per_step": len(syncs) / count,
        "host_sync_ms": sum(_ms(e.time_range) for e in syncs) / count,
        "top_ops": [
            {
                "name": name,
                "calls": int(row["calls"]),
                **{k: row[k] / count for k in ("self_ms", "total_ms", "device_ms")},
            }
            for name, row in top
        ],
    }


def describe(summary: dict[str, Any]) -> str:
    """One line: where the profiled steps' time went."""
    step, split = summary["step_ms"], summary["split_ms"]
    shares = ", ".join(
        f"{label} {split[key] / step:.0%}" if step else f"{label} -"
        for key, label in (("forward", "forward"), ("backward", "backward"), ("optimizer", "optimizer"),
                           ("other", "data and host code"))
    )  # fmt: skip
    first, last = summary["steps"]
    return (
        f"profiled steps {first}-{last}: {step:.2f} ms a step: {shares}; "
        f"{summary['host_syncs_per_step']:g} host syncs a step ({summary['host_sync_ms']:.2f} ms)"
    )


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """A run's ``profile/summary.json``, or None when it has none (or an unreadable one)."""
    try:
        return json.loads((Path(run_dir) / "profile" / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _ms(time_range: Any) -> float:
    return (time_range.end - time_range.start) / 1e3


def _span(events: list[Any]) -> float:
    return (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3 if events else 0.0


def _descendants(event: Any) -> Iterable[Any]:
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)
