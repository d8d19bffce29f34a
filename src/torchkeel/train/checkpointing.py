"""A Trainer's checkpoints: where they go, when they are due, and what one holds on several ranks.

``RunCheckpoints`` owns the store, the background saver and the cadence, and knows the job's
layout: full weights written by rank 0 (with every rank's RNG and data position gathered to it),
or each rank's shards under FSDP. ``save`` and ``restore`` are the only two ways in; once the
run is bound to it (``bind``), it decides when the run saves (``maybe_save`` after a step,
``at_epoch_end``, ``save_now``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchkeel.checkpoint import (
    AsyncSaver,
    Checkpoint,
    CheckpointStore,
    capture_training_state,
    restore_training_state,
)
from torchkeel.checkpoint.format import PointHook
from torchkeel.checkpoint.sharded import load_sharded, save_sharded
from torchkeel.config.schema import CheckpointConfig
from torchkeel.data.build import Loader
from torchkeel.data.inputs import Inputs, fingerprint_inputs
from torchkeel.distributed.agree import any_rank
from torchkeel.distributed.job import TrainingJob
from torchkeel.distributed.shared import check_shared_directory, spans_nodes
from torchkeel.errors import CheckpointError
from torchkeel.rng import capture_rng, restore_rng
from torchkeel.train.cadence import SaveCadence
from torchkeel.train.carry import CarriedState
from torchkeel.train.counters import RunCounters, TrainingParts
from torchkeel.train.early_stop import EarlyStopping
from torchkeel.train.incidents import IncidentLog
from torchkeel.train.protect import BadSampleReport, Protections
from torchkeel.train.resume import check_resume_config, check_resume_inputs, find_checkpoint
from torchkeel.train.rundir import RunFiles
from torchkeel.train.schedule import replan


@dataclass
class RunState:
    """What a checkpoint carries besides the weights, from the components that own it: where the
    run stands, the protections' and early stopping's state, the incidents so far, the position in
    the data (``loader``), the state carried across batches (``carry``, each rank's own)."""

    counters: RunCounters
    protections: Protections
    bad_samples: BadSampleReport
    incidents: IncidentLog
    stopper: EarlyStopping | None
    loader: Loader
    carry: CarriedState | None = None

    def progress(self) -> dict[str, Any]:
        return {
            **self.counters.state_dict(),
            "diagnosis": self.protections.diagnosis,
            "early_stop": self.stopper.state_dict() if self.stopper else None,
        }

    def protection_state(self) -> dict[str, Any]:
        return {
            **self.protections.state_dict(),
            "incidents": dict(self.incidents.counts),
            "shown_bad": self.bad_samples.state_dict(),
        }

    def load(self, progress: dict[str, Any], protections: dict[str, Any]) -> None:
        self.counters.load_state_dict(progress)
        self.protections.diagnosis = progress.get("diagnosis")
        if self.stopper is not None and progress.get("early_stop") is not None:
            self.stopper.load_state_dict(progress["early_stop"])
        if progress.get("data"):
            self.loader.load_state_dict(progress["data"])
        self.protections.load_state_dict(protections)
        self.incidents.counts.update(protections.get("incidents", {}))
        self.bad_samples.load_state_dict(protections.get("shown_bad", []))


@dataclass(frozen=True)
class _Bound:
    parts: TrainingParts
    run: RunState
    files: RunFiles
    read_ahead: Callable[[], int]
    meta: dict[str, Any]


@dataclass(frozen=True)
class ResumeChanges:
    """What a resume may continue over: a config that changes what the run computes
    (``--allow-config-change``), changed data files (``--allow-data-change``)."""

    config: bool = False
    data: bool = False


class RunCheckpoints:
    """Saves and restores a Trainer's run in ``directory``, with ``cfg``'s retention and cadence."""

    def __init__(
        self, cfg: CheckpointConfig, directory: Path, job: TrainingJob, *, hook: PointHook | None = None
    ) -> None:
        self.cfg, self.job = cfg, job
        self._bound: _Bound | None = None
        self.store = CheckpointStore(
            directory, keep_last=cfg.keep_last, save_top_k=cfg.save_top_k, monitor=cfg.monitor, mode=cfg.mode, hook=hook
        )
        # Sharded saves are collective: every rank writes its shards at the same time.
        self.saver = AsyncSaver(self.store) if cfg.async_save and not job.sharded else None
        self.cadence = SaveCadence(cfg.every_s, cfg.max_overhead)
        if cfg.enabled and job.active and spans_nodes(job.rank.world_size):
            check_shared_directory(directory, job.rank.rank, job.all_gather_object)

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def find(self, resume: str | Path, warn: Callable[[str], None]) -> Checkpoint | None:
        """The checkpoint to resume from (``"auto"``: the newest valid one, or ``None``)."""
        return find_checkpoint(self.store, resume, warn)

    def resumable(
        self,
        resume: str | Path | None,
        config: dict[str, Any],
        sources: dict[str, Any],
        allow: ResumeChanges,
        warn: Callable[[str], None] | None,
    ) -> tuple[Checkpoint | None, list[str], Inputs]:
        """``find``'s checkpoint (none when ``resume`` is not set), the lines that say what differs
        from it, and the identity of the data files (``fingerprint_inputs`` of ``sources``), which
        every checkpoint of the run records. A change in what the run computes is refused unless
        ``allow.config`` (``check_resume_config``), changed data files unless ``allow.data``
        (``check_resume_inputs``)."""
        found = self.find(resume, warn or (lambda message: None)) if resume else None
        inputs = fingerprint_inputs(sources, known=found.manifest.get("inputs") if found is not None else None)
        if found is None:
            return None, [], inputs
        where = {"checkpoint": found.path}
        return (
            found,
            [
                *check_resume_config(found.manifest, config, allow=allow.config, **where),
                *check_resume_inputs(found.manifest, inputs, allow=allow.data, **where),
            ],
            inputs,
        )

    def is_due(self, at_epoch_end: bool) -> bool:
        """Whether the time-based cadence asks for a save. Rank 0's clock decides; the other ranks
        learn it in the agreement that follows."""
        return self.cfg.enabled and self.job.rank.is_main and self.cadence.is_due(at_epoch_end)

    def is_every_steps(self, step: int) -> bool:
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def bind(
        self,
        parts: TrainingParts,
        run: RunState,
        files: RunFiles,
        *,
        read_ahead: Callable[[], int],
        meta: dict[str, Any],
    ) -> None:
        """What this run's saves hold (``parts``, ``run``, the data position less the
        ``read_ahead()`` batches read ahead, ``meta`` in the manifest) and the files they keep in
        step; set once the run's files are open."""
        self._bound = _Bound(parts, run, files, read_ahead, meta)

    def maybe_save(self, step: int, *, last_of_epoch: bool, due: bool = False) -> None:
        """After step ``step``: save when ``checkpoint.every_steps`` says so or a save is ``due``
        (agreed by every rank: a stop signal, rank 0's clock). At the epoch's last step
        ``at_epoch_end`` decides instead."""
        if not last_of_epoch and (due or self.is_every_steps(step)):
            self.save_now()

    def at_epoch_end(self, step: int, *, wanted: bool = False) -> None:
        """The epoch ended at step ``step``: save when the time cadence allows an epoch-end save
        (rank 0's clock, agreed here by every rank), ``checkpoint.every_steps`` says so, or a
        save is ``wanted`` (the best state so far, early stopping's)."""
        with self.job.watch("the agreement on saving", step):
            due = any_rank(self.is_due(True), self.job.device)
        if due or wanted or self.is_every_steps(step):
            self.save_now()

    def save_now(self) -> None:
        """Checkpoint the bound run's current state, once per step at most (every rank takes part)."""
        bound = self._bound
        assert bound is not None, "RunCheckpoints.bind() first"
        counters = bound.run.counters
        if not self.enabled or counters.saved_at == counters.step:
            return
        counters.saved_at = counters.step
        bound.files.flush()
        # The first checkpoint must be on disk before the run --overwrite set aside goes.
        wait = bound.files.holds_previous
        self.save(bound.parts, bound.run, read_ahead=bound.read_ahead(), meta=bound.meta, wait=wait)
        bound.files.first_checkpoint_written()

    def save(
        self, parts: TrainingParts, run: RunState, *, read_ahead: int, meta: dict[str, Any], wait: bool = False
    ) -> None:
        """Checkpoint the run. Every rank takes part (its RNG, and its position in the data less
        the latest ``read_ahead`` batches, read ahead and not trained on); rank 0 writes, except each rank's
        shards under FSDP. ``wait``: the checkpoint is on disk when this returns."""
        progress = run.progress()
        step, epoch = progress["step"], progress["epoch"]
        job, is_main = self.job, self.job.rank.is_main
        with job.watch("saving a checkpoint", step):
            # Under torchrun every rank's RNG and position; in one process capture_training_state's suffice.
            carry = run.carry.state_dict() if run.carry is not None else None
            ranks = job.gather(
                {
                    "rng": capture_rng() if job.active else None,
                    "data": run.loader.state_dict(read_ahead),
                    "carry": carry,
                }
            )
            state: dict[str, Any] = {}
            if is_main:
                assert ranks is not None
                progress["data"] = ranks[0]["data"] if len(ranks) == 1 else [r["data"] for r in ranks]
                state = capture_training_state(
                    parts.model,
                    parts.optimizer,
                    parts.scheduler,
                    parts.scaler,
                    progress,
                    run.protection_state(),
                    weights=not job.sharded,
                )
                if len(ranks) > 1:
                    state["ranks"] = {"rng": [r["rng"] for r in ranks]}
                if run.carry is not None:
                    state["carry"] = [r["carry"] for r in ranks]  # one per rank, in rank order
                if parts.ema is not None:
                    state["ema"] = parts.ema.state_dict()
            kwargs = {"step": step, "epoch": epoch, "metrics": run.counters.val_metrics, "meta": meta}
            start = time.perf_counter()
            if job.sharded:
                save_sharded(self.store, state, parts.model, parts.optimizer, hook=self.store.hook, **kwargs)
            elif not is_main:
                return
            elif self.saver is not None:
                self.saver.save(state, **kwargs)
                if wait:
                    self.saver.wait()
            else:
                self.store.save(state, **kwargs)
        self.cadence.saved(time.perf_counter() - start)

    def restore(
        self,
        found: Checkpoint,
        parts: TrainingParts,
        run: RunState,
        seed: int,
        *,
        warn: Callable[[str], None] | None = None,
    ) -> int | None:
        """Load ``found`` into ``parts``, ``run`` and this rank's RNG. Returns ``None``, or the number
        of ranks that wrote it when each rank's random stream could not be continued (reseeded),
        which ``warn`` hears of.

        Raises:
            CheckpointError: the checkpoint's layout (sharded or not) is not this run's strategy.
        """
        job = self.job
        if (found.shards is not None) != job.sharded:
            written = "dist.strategy=fsdp" if found.shards is not None else "full weights (no FSDP)"
            raise CheckpointError(
                f"checkpoint '{found.path}' was written with {written}, this run uses dist.strategy="
                f"{job.cfg.strategy}: resume with the strategy it was written with (on any number of "
                "ranks), or start from its weights with model.init_from"
            )
        if found.shards is not None:
            load_sharded(found, parts.model, parts.optimizer)
        progress = restore_training_state(found.state, parts.model, parts.optimizer, parts.scheduler, parts.scaler)
        if parts.scheduler is not None and parts.optimizer is not None:
            replan(parts.scheduler, parts.optimizer)  # this run's plan from now (the built-in schedule)
        if parts.ema is not None and found.state.get("ema") is not None:
            parts.ema.load_state_dict(found.state["ema"])  # else the average starts afresh from these weights
        run.load(progress, found.state.get("protections") or {})
        if run.carry is not None:
            _restore_carry(run.carry, found.state.get("carry") or [], job, warn)
        per_rank_rng = (found.state.get("ranks") or {}).get("rng") or []
        world = job.rank.world_size
        if len(per_rank_rng) == world > 1:
            restore_rng(per_rank_rng[job.rank.rank])  # dropout continues exactly on every rank
        elif world > 1 or per_rank_rng:
            job.seed_rank(seed + progress["step"])
            written = max(1, len(per_rank_rng))
            if warn is not None:
                warn(
                    f"the checkpoint was written by {written} rank{'s' * (written > 1)}, this run has {world}: "
                    "each rank's random stream (dropout) starts afresh"
                )
            return written
        return None

    def wait(self) -> None:
        """The save in flight is on disk."""
        if self.saver is not None:
            self.saver.wait()

    def join(self) -> None:
        """Let a save in flight land (a complete state), and stop the background writer."""
        if self.saver is not None:
            self.saver.join()


def _restore_carry(
    carry: CarriedState, saved: list[dict[str, Any]], job: TrainingJob, warn: Callable[[str], None] | None
) -> None:
    """Each rank continues its own carried state; from a checkpoint of another number of ranks
    (whose rows were other streams) or without one, the state starts afresh, as ``warn`` hears."""
    world = job.rank.world_size
    if len(saved) == world:
        carry.load_state_dict(saved[job.rank.rank], job.device)
        return
    carry.load_state_dict({"train": None})
    if warn is not None:
        where = f"{len(saved)} ranks" if saved else "no carried state"
        warn(
            f"train.carry: the checkpoint holds {where}, this run has {world} rank(s): the carried state starts afresh"
        )
