"""Preemption safety: turn SIGTERM/SIGINT into a request to stop after the current optimizer step.

The training loop asks ``requested`` after every step, saves a checkpoint and exits with
128 + the signal number. A second SIGINT (Ctrl-C twice) aborts at once. SIGUSR1, the warning a
scheduler sends before a time limit (Slurm's ``--signal=USR1@120``), is a preemption like SIGTERM:
save, then exit 143. A run stopped before it finished never exits 0, on any rank: a rank that got
no signal of its own but stopped because another rank did (every rank stops together) ends
preempted too (``StopSignals.stop_agreed``), so that no node of a stopped job reports success.
Under Slurm, rank 0 then asks for a requeue (:mod:`torchkeel.cluster.requeue`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

WARNING_SIGNALS: tuple[int, ...] = tuple(s for s in (getattr(signal, "SIGUSR1", None),) if s is not None)
"""A scheduler's warning before its time limit (not on Windows)."""
PREEMPT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, *WARNING_SIGNALS)


def preempt_exit_code(signal_name: str) -> int:
    """128 + the signal's number; a scheduler's warning exits as SIGTERM would (143)."""
    signum = signal.Signals[signal_name].value
    return 128 + (signal.SIGTERM.value if signum in WARNING_SIGNALS else signum)


class StopSignals:
    """Context manager that records SIGTERM/SIGINT instead of dying mid-step.

    Handlers are installed only in the main thread (Python's rule) and restored on exit.
    """

    def __init__(self, signals: tuple[int, ...] = PREEMPT_SIGNALS) -> None:
        self.signals = signals
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @property
    def name(self) -> str | None:
        """``SIGTERM``/``SIGINT``/``SIGUSR1`` once a stop was requested."""
        return None if self.requested is None else signal.Signals(self.requested).name

    def stop_agreed(self) -> None:
        """Every rank stops because some rank was signalled: one that received no signal itself
        records SIGTERM (a scheduler's stop), so that it too ends preempted, not completed."""
        if self.requested is None:
            self.requested = signal.SIGTERM

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now, no checkpoint
        self.requested = signum
