"""Test seams: fault injection and measurements that tests and benchmarks use, kept out of the
public API (``torchkeel.__all__``).

Fault injection at the named points of a checkpoint write (``parse_fault_rules``).

Rules, comma-separated:

- ``kill:POINT#N``: SIGKILL this process the N-th time ``POINT`` is reached (N defaults to 1);
- ``sleep:POINT=SECONDS``: pause at ``POINT`` every time, to make the write window findable.

Points: ``<file>:before_temp``, ``<file>:mid_write``, ``<file>:after_write``,
``<file>:after_fsync``, ``<file>:after_replace`` for each of ``model.safetensors``,
``state.safetensors`` and ``state.json``, then ``before_manifest`` and ``after_manifest``.
``hooks_from_env`` reads the rules from ``TORCHKEEL_TEST_FAULTS``.

Training-step faults (``TORCHKEEL_TEST_STEP_FAULTS``), run before each forward pass:

- ``oom:MAX``: raise ``torch.OutOfMemoryError`` for pieces of more than MAX samples;
- ``sleep:N=SECONDS``: pause before the N-th forward pass (a stalled rank);
- ``kill:N``: SIGKILL this process before the N-th forward pass.

A slow served model (``TORCHKEEL_TEST_FORWARD_SLEEP_S``, ``slow_forwards_from_env``, which
``keel serve`` calls): every forward of the batcher pauses that long first, so that requests are
certainly in flight.

``hooks_from_env`` is the one reader of the training faults; ``keel train`` and Ray's workers
get their Trainer through ``torchkeel.integrations.command.command_trainer``, which calls it.

Any rule may end in ``@rank=R`` (only on that rank) and ``@restart=K`` (only in torchrun's K-th
restart of the workers, ``TORCHELASTIC_RESTART_COUNT``), so that a fault happens once per job.
Where no launcher counts restarts (Ray), ``@once=PATH`` does that: the rule holds while ``PATH``
does not exist, and a ``kill`` creates it before it fires.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from torchkeel.checkpoint.format import PointHook
from torchkeel.introspect.memory import rss_bytes
from torchkeel.train.hooks import TrainerHooks

CHECKPOINT_FAULTS = "TORCHKEEL_TEST_FAULTS"
STEP_FAULTS = "TORCHKEEL_TEST_STEP_FAULTS"
FORWARD_SLEEP = "TORCHKEEL_TEST_FORWARD_SLEEP_S"


def hooks_from_env(environ: Mapping[str, str] | None = None) -> TrainerHooks | None:
    """The Trainer's fault injection that ``TORCHKEEL_TEST_FAULTS`` (checkpoint writes) and
    ``TORCHKEEL_TEST_STEP_FAULTS`` (training steps) describe; ``None`` when neither is set."""
    env = os.environ if environ is None else environ
    faults, step_faults = env.get(CHECKPOINT_FAULTS), env.get(STEP_FAULTS)
    if not (faults or step_faults):
        return None
    return TrainerHooks(
        checkpoint=parse_fault_rules(faults) if faults else None,
        before_forward=parse_step_faults(step_faults) if step_faults else None,
    )


def slow_forwards_from_env(models: Iterable[Any], environ: Mapping[str, str] | None = None) -> None:
    """Slow every served model's batch forward by ``TORCHKEEL_TEST_FORWARD_SLEEP_S`` seconds, when set."""
    delay = (os.environ if environ is None else environ).get(FORWARD_SLEEP)
    if delay:
        for model in models:
            model.batcher.run_batch = slowed(model.batcher.run_batch, float(delay))


def parse_fault_rules(spec: str) -> PointHook:
    """A hook for ``CheckpointStore(hook=...)`` that carries out ``spec``'s rules."""
    kills: dict[str, int] = {}
    sleeps: dict[str, float] = {}
    for rule in _rules(spec):
        action, _, rest = rule.partition(":")
        if action == "kill":
            point, _, nth = rest.partition("#")
            kills[point] = int(nth or 1)
        elif action == "sleep":
            point, _, seconds = rest.rpartition("=")
            sleeps[point] = float(seconds)
        else:
            raise ValueError(f"unknown fault rule {rule!r}; use kill:POINT#N or sleep:POINT=SECONDS")
    seen: Counter[str] = Counter()

    def hook(point: str) -> None:
        seen[point] += 1
        if point in sleeps:
            time.sleep(sleeps[point])
        if kills.get(point) == seen[point]:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def parse_step_faults(spec: str) -> Callable[[int], None]:
    """A ``TrainerHooks.before_forward(num_samples)`` hook that carries out ``spec``."""
    oom: OomInjector | None = None
    sleeps: dict[int, float] = {}
    kills: dict[int, str | None] = {}
    for rule, once in _scoped_rules(spec):
        action, _, rest = rule.partition(":")
        if action == "oom":
            oom = OomInjector(int(rest))
        elif action == "sleep":
            nth, _, seconds = rest.partition("=")
            sleeps[int(nth)] = float(seconds)
        elif action == "kill":
            kills[int(rest)] = once
        else:
            raise ValueError(f"unknown step fault {rule!r}; use oom:MAX, sleep:N=SECONDS or kill:N")
    calls = 0

    def hook(num_samples: int) -> None:
        nonlocal calls
        calls += 1
        if calls in sleeps:
            time.sleep(sleeps[calls])
        if calls in kills:
            marker = kills[calls]
            if marker is not None:
                open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if oom is not None:
            oom(num_samples)

    return hook


def _rules(spec: str) -> list[str]:
    """The rules of ``spec`` that apply to this process, without their scopes."""
    return [rule for rule, _ in _scoped_rules(spec)]


def _scoped_rules(spec: str) -> list[tuple[str, str | None]]:
    """The rules that apply to this process (``@rank``, ``@restart``, ``@once``), each with its
    ``@once`` marker path (or ``None``)."""
    here = {"rank": os.environ.get("RANK", "0"), "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}
    kept = []
    for rule in filter(None, (r.strip() for r in spec.split(","))):
        rule, *scopes = rule.split("@")
        pairs = [scope.partition("=")[::2] for scope in scopes]
        once = next((value for key, value in pairs if key == "once"), None)
        if once is not None and os.path.exists(once):
            continue
        if all(here.get(key) == value for key, value in pairs if key != "once"):
            kept.append((rule, once))
    return kept


def slowed(forward: Callable[[Any], Any], seconds: float) -> Callable[[Any], Any]:
    """``forward`` that sleeps ``seconds`` before each call."""

    def slow(batch: Any) -> Any:
        time.sleep(seconds)
        return forward(batch)

    return slow


class OomInjector:
    """Fault injection: raises ``torch.OutOfMemoryError`` for micro-batches above ``max_samples``.

    Pass it as ``TrainerHooks(before_forward=OomInjector(16))`` to ``StepSettings(hooks=)`` or
    ``Trainer(hooks=)`` to exercise the split path on a CPU.
    """

    def __init__(self, max_samples: int) -> None:
        self.max_samples = max_samples
        self.num_raised = 0

    def __call__(self, num_samples: int) -> None:
        if num_samples > self.max_samples:
            self.num_raised += 1
            raise torch.OutOfMemoryError(
                f"injected: a micro-batch of {num_samples} samples is above {self.max_samples}"
            )


def peak_rss_during(fn: Callable[[], Any], interval_s: float = 0.001) -> tuple[int, Any]:
    """Run ``fn``; return how far the RSS rose above its level before the call at its peak
    (sampled every ``interval_s`` by a thread), and ``fn``'s result. For measuring what a save,
    a load or a step costs in memory."""
    start, peak, done = rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(interval_s)

    thread = threading.Thread(target=sample, name="torchkeel-rss", daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0], rss_bytes()) - start, result
