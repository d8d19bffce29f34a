"""What acts after each training step: the non-finite guard (skip, roll back, fail), loss spikes,
memory, leaks, waiting for input and out-of-memory splits.

``Protections.after_step`` reads a step's result and returns what it found — incidents that
carry their own messages, and metrics rows — as diagnose's detectors return findings; the
Trainer only records them. Every rank feeds it the same agreed verdicts, so every rank takes the
same action (a rollback, a stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchkeel.config.schema import GuardConfig, KeelConfig, MemoryConfig
from torchkeel.data.build import Loader
from torchkeel.distributed.job import TrainingJob
from torchkeel.errors import DataError, KeelError, TrainingDiverged
from torchkeel.train.counters import TrainingParts
from torchkeel.train.guards import Action, NonFiniteGuard, SpikeDetector
from torchkeel.train.inputbound import InputBoundDetector
from torchkeel.train.memory import LeakDetector, MemoryMonitor, MemoryReader
from torchkeel.train.nonfinite import diagnose_nonfinite
from torchkeel.train.objective import Objective
from torchkeel.train.precision import Precision
from torchkeel.train.rollback import Rollback
from torchkeel.train.step import StepResult

MAX_SHOWN_BAD = 10_000  # bad samples a checkpoint remembers as printed (beyond: printed again after a resume)


@dataclass
class Incident:
    """One protection that acted: ``kind`` (``incidents.jsonl``), a message for a person, details."""

    kind: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    quiet: bool = False
    """In the files, not printed again (a bad sample already shown)."""


@dataclass
class Observed:
    """What ``after_step`` found: incidents to record and metrics rows to log."""

    incidents: list[Incident] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    error: KeelError | None = None
    """Raise it once the incidents are recorded: the guard gave up, or too many bad samples."""


class Protections:
    """The run's protections, each built from its own config section (``from_config``).

    ``rollback`` (``None``: none) restores ``parts`` when the guard answers ``ROLLBACK``;
    ``objective`` and ``precision`` let the first non-finite step be diagnosed
    (``guard.diagnose``); ``num_workers`` is named in the advice when the run waits on its input.
    """

    def __init__(
        self,
        guard: GuardConfig,
        memory: MemoryConfig,
        parts: TrainingParts,
        objective: Objective,
        precision: Precision,
        device: torch.device,
        num_workers: int,
        reader: MemoryReader | None = None,
    ) -> None:
        self.objective, self.precision, self.device, self.num_workers = objective, precision, device, num_workers
        self.parts, self.diagnose = parts, guard.diagnose
        self.guard = NonFiniteGuard.from_config(guard)
        self.rollback = Rollback.from_config(guard, parts)
        self.spikes = SpikeDetector.from_config(guard)
        self.memory, self.memory_every = MemoryMonitor.from_config(memory, device, reader), memory.every_steps
        self.leaks = LeakDetector.from_config(memory, device, reader)
        self.input_bound = InputBoundDetector()
        self.diagnosis: dict[str, Any] | None = None  # of the first non-finite step

    @classmethod
    def from_config(cls, cfg: KeelConfig, *args: Any, **kwargs: Any) -> Protections:
        """The protections ``cfg.guard`` and ``cfg.memory`` describe; the other arguments as
        ``Protections`` takes them (``parts``, ``objective``, ...)."""
        return cls(cfg.guard, cfg.memory, *args, **kwargs)

    def take_snapshot(self, step: int) -> None:
        """Keep the state of ``step`` for a rollback (only when the guard can roll back)."""
        if self.rollback is not None:
            self.rollback.take(step)

    def after_step(self, result: StepResult, group: Sequence[Any], step: int, wait_s: float) -> Observed:
        """Act on one step's result (``step``: the steps done, this one included; ``wait_s``: the
        time spent waiting for its batches). When the guard gives up (``guard.on_nonfinite: raise``,
        or too many rollbacks) the result's ``error`` is the ``TrainingDiverged`` to raise.
        """
        found = Observed()
        add = found.incidents.append
        waiting = self.input_bound.observe(wait_s)
        if waiting is not None:
            add(
                Incident(
                    "input_bound",
                    f"input-bound: {waiting['wait_fraction']:.0%} of the time went to waiting "
                    f"for the next batch ({waiting['wait_s_per_step'] * 1e3:.1f} ms a step, the step itself "
                    f"{waiting['compute_s_per_step'] * 1e3:.1f} ms); raise data.num_workers (now "
                    f"{self.num_workers}), make __getitem__ cheaper, or cache the decoded data",
                    waiting,
                )
            )
        if result.num_oom_splits:
            add(
                Incident(
                    "oom_split",
                    f"out of memory: the step was redone in micro-batches of "
                    f"{result.micro_batch_size} samples, kept for the following steps",
                    {"micro_batch_size": result.micro_batch_size, "splits": result.num_oom_splits},
                )
            )
        if result.status == "nonfinite":
            self._on_nonfinite(group, found)
        else:
            self.guard.observe(True)
            rollback = self.rollback
            if rollback is not None and step % rollback.every == 0 and result.status == "ok":
                rollback.take(step)  # Rollback.after_step, without a call on the other steps
        if self.spikes is not None and result.loss_value is not None:
            average = self.spikes.observe(result.loss_value)
            if average is not None:
                add(
                    Incident(
                        "spike",
                        f"loss {result.loss_value:.4g} is above {self.spikes.factor} x its "
                        f"running average {average:.4g}",
                        {"loss": result.loss_value, "average": average},
                    )
                )
        if self.memory_every and step % self.memory_every == 0:
            stats, warnings = self.memory.sample()
            found.rows.append({"kind": "memory", "step": step, **stats.row()})
            found.incidents += [Incident("memory", warning, stats.row()) for warning in warnings]
        leak = self.leaks.observe(step) if self.leaks is not None else None
        if leak is not None:
            add(_leak_incident(leak))
        return found

    def _on_nonfinite(self, group: Sequence[Any], found: Observed) -> None:
        diagnosis = None
        if self.diagnose and self.diagnosis is None:  # the first non-finite step only
            diagnosis = self.diagnosis = diagnose_nonfinite(
                self.parts.model, group, self.objective, precision=self.precision, device=self.device
            )
        rollback = self.rollback
        action = self.guard.observe(False, can_roll_back=rollback is not None and rollback.can_restore)
        found.incidents.append(
            Incident(
                "nonfinite",
                f"non-finite loss or gradients: step skipped ({action.value})"
                + (f"; {diagnosis['summary']}" if diagnosis else ""),
                {"action": action.value, "diagnosis": diagnosis},
            )
        )
        if action is Action.ROLLBACK:
            assert rollback is not None  # can_roll_back said so
            to_step = rollback.restore(self.guard.lr_scale)
            found.incidents.append(
                Incident(
                    "rollback",
                    f"rolled back to the state of step {to_step}; learning rate scaled to {self.guard.lr_scale:g} x",
                    {"to_step": to_step, "lr_scale": self.guard.lr_scale},
                )
            )
        elif action is Action.FAIL:
            first = self.diagnosis["summary"] if self.diagnosis else "no diagnosis"
            found.error = TrainingDiverged(
                f"training diverged: {self.guard.num_skipped} non-finite steps, {self.guard.num_rollbacks} "
                f"rollbacks; {first}. Lower optim.lr, check the data and incidents.jsonl",
                self.diagnosis,
            )

    def state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict(), "spikes": self.spikes.state_dict() if self.spikes else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state.get("guard", {}))
        if self.spikes is not None and state.get("spikes"):
            self.spikes.load_state_dict(state["spikes"])


def _leak_incident(finding: dict[str, Any]) -> Incident:
    top = finding["top_groups"][0] if finding["top_groups"] else None
    what = (
        f"; most added: {top['added']} tensors of shape {top['shape']} {top['dtype']}"
        + (" holding autograd graphs" if top["holds_graph"] else "")
        if top
        else ""
    )
    return Incident(
        "leak",
        f"memory grows every census ({finding['signal']}): "
        f"{finding['graph_nodes_per_step']:.1f} graph nodes and {finding['tensors_per_step']:.2f} "
        f"tensors per step{what} — a tensor kept across steps (total_loss += loss?)",
        finding,
    )


class BadSampleReport:
    """Every rank's new bad samples, as incidents for rank 0's file; each printed once per run.

    With several ranks the samples are shared first (one gather, only at steps where some rank
    met one), so that every rank decides the same on ``data.max_bad_fraction``.
    """

    def __init__(self, job: TrainingJob) -> None:
        self.job = job
        self.shown: set[str] = set()  # printed already: once per run, every occurrence in incidents

    def collect(self, loader: Loader, read_ahead: int = 0) -> Observed:
        """The incidents of the loader's new bad samples on every rank (taken from its ledger);
        the result's ``error`` is the ``DataError`` to raise once they are recorded, when the
        job's share of bad samples passed ``data.max_bad_fraction``. Those of the latest
        ``read_ahead`` batches (read ahead, not trained on) wait for the step that trains on
        them: a checkpoint taken before it does not count them, so a run resumed from it meets
        them again."""
        ledger = loader.bad
        found = Observed()
        for rank, bad in enumerate(self.job.all_gather_object(ledger.take_new(read_ahead))):
            if rank != self.job.rank.rank:
                ledger.add_others(bad)
            for where, error in bad:
                found.incidents.append(
                    Incident(
                        "bad_sample",
                        f"skipped a bad sample: {where}: {error}",
                        {"where": where, "error": error, "rank": rank},
                        quiet=where in self.shown,
                    )
                )
                self.shown.add(where)
        try:
            ledger.check(read_ahead)
        except DataError as exc:
            found.error = exc
        return found

    def state_dict(self) -> list[str]:
        return sorted(self.shown)[:MAX_SHOWN_BAD]

    def load_state_dict(self, shown: list[str]) -> None:
        self.shown.update(shown)
