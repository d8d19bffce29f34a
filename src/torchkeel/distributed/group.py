"""The job's process group: started from torchrun's environment, timed out, always torn down.

``torchrun`` (or SLURM + ``torchrun``) does the launching and the rendezvous; this component only
joins the group it describes, with the backend that fits the device, a generous timeout for the
rendezvous and the first step and a tighter one afterwards, and a clear error naming the rank
that stopped arriving when a collective times out.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist

from torchkeel.config.schema import DistConfig
from torchkeel.distributed.rank import RankInfo
from torchkeel.errors import ConfigError, KeelError, first_line

# Keys of the job's store (the round's namespace under torchrun) through which ranks say who they
# are, who failed first with what, and who is still there after a peer went away.
_WHO, _ALIVE, _ERRORS, _FIRST = "torchkeel/who/", "torchkeel/alive/", "torchkeel/errors", "torchkeel/first-error"
ENDED_WAIT_S = 3.0  # how long a rank whose peer went away waits for the others to say they are there
_MISSING_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


class CollectiveTimeout(KeelError):
    """A collective waited past ``dist.timeout_s``: some rank stopped arriving."""


_NOTHING = nullcontext()


def default_backend(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


class JobGroup:
    """Joins the process group torchrun describes (``WORLD_SIZE`` > 1) and owns its lifetime.

    In a single process (no torchrun) it does nothing and ``active`` is false, so a caller uses
    it unconditionally. ``close()`` destroys the group on every exit path; it is idempotent.

    Example (a hand-written loop under torchrun)::

        group = JobGroup(DistConfig(), RankInfo.from_env(), device)
        try:
            ...  # first step
            group.first_step_done()
            ...
        finally:
            group.close()
    """

    def __init__(self, cfg: DistConfig, rank: RankInfo, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.backend = cfg.backend or default_backend(device)
        self.owned = False
        self._monitor: dist.ProcessGroup | None = None
        self._tight = False
        self._stepped = False  # first_step_done() was called
        if rank.world_size > 1 and not dist.is_initialized():
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise ConfigError(
                    f"WORLD_SIZE={rank.world_size} is set but not {' or '.join(missing)}: start "
                    "the job with torchrun (or keel train --nproc N), which sets both"
                )
            # The device is set before this (resolve_device), so NCCL binds each rank to its GPU.
            timeout = datetime.timedelta(seconds=cfg.init_timeout_s)
            shared, rank_, world = next(dist.rendezvous("env://", timeout=timeout))
            dist.init_process_group(
                self.backend,
                store=round_store(shared, rank_),
                rank=rank_,
                world_size=world,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
            self.owned = True
            end_round(shared, rank_)
        self._store: dist.Store | None = None
        if self.active:
            # A gloo side group, only for naming the missing rank after a timeout (monitored_barrier).
            self._monitor = dist.new_group(backend="gloo")
            self._store = dist.distributed_c10d._get_default_store()
            self._store.set(_WHO + str(dist.get_rank()), f"{socket.gethostname()}, pid {os.getpid()}")

    @property
    def active(self) -> bool:
        """Whether this process is part of a group of several ranks."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def first_step_done(self) -> None:
        """Switch to ``dist.timeout_s``: the slow first collectives (rendezvous, compilation) are past."""
        if self._stepped:  # called after every step: only the first does anything
            return
        self._stepped = True
        if self.active:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.cfg.timeout_s))
            self._tight = True

    @property
    def timeout_s(self) -> float:
        return self.cfg.timeout_s if self._tight else self.cfg.init_timeout_s

    def watch(self, what: str, step: int) -> AbstractContextManager[None]:
        """Turn a collective's timeout inside the block into a ``CollectiveTimeout`` that names
        the collective (``what``), the step and, where the backend can tell, the missing rank.
        In one process (no collectives) the block runs as it is."""
        return self._watch(what, step) if self._monitor is not None else _NOTHING  # _monitor: active, open

    def watch_step(self, step: int) -> AbstractContextManager[None]:
        """``watch`` around training step ``step``; once a step has passed, ``first_step_done``.
        In one process it is a shared no-op: this runs at every step."""
        return self._watch_step(step) if self._monitor is not None else _NOTHING

    @contextmanager
    def _watch_step(self, step: int) -> Iterator[None]:
        with self._watch("the training step (forward, backward, gradient sync)", step):
            yield
        self.first_step_done()

    @contextmanager
    def _watch(self, what: str, step: int) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            if not self.active or not _is_comm_failure(exc):
                raise
            raise CollectiveTimeout(self._explain(exc, what, step, time.monotonic() - start)) from exc

    def _explain(self, exc: BaseException, what: str, step: int, waited_s: float) -> str:
        # A peer that died breaks the connection long before the timeout, whatever the backend's words.
        if "connection closed by peer" in str(exc).lower() or waited_s < 0.5 * self.timeout_s:
            return f"rank {self.rank.rank}: {what} at step {step} failed: {self._who_ended_first()}"
        missing = self._missing_ranks()
        who = (
            f"rank {', '.join(map(str, missing))} did not arrive"
            if missing
            else "a rank did not arrive (this backend does not say which)"
        )
        key = "dist.timeout_s" if self._tight else "dist.init_timeout_s"
        return (
            f"rank {self.rank.rank}: {what} at step {step} timed out after {self.timeout_s:g} s ({key}): "
            f"{who}; stuck in data loading or a slow step? Raise {key} if the wait is expected"
        )

    def tell_failure(self, exc: Exception) -> None:
        """This rank's own error, for the messages of the ranks it leaves behind (the job's first
        error only; a rank that failed because another went away tells nothing)."""
        if self._store is None or isinstance(exc, CollectiveTimeout):
            return
        try:
            if self._store.add(_ERRORS, 1) == 1:
                where = f"rank {dist.get_rank()} on {socket.gethostname()}"
                self._store.set(_FIRST, f"{where} ended first: {type(exc).__name__}: {first_line(exc)}")
        except (RuntimeError, dist.DistError):  # the store went with the process that held it
            pass

    def _who_ended_first(self) -> str:
        """Which rank (and machine) ended first and how: its own error where it told one; else the
        ranks that do not say they are still there after ``ENDED_WAIT_S`` (killed, or exited)."""
        store, fallback = self._store, "another rank ended first (its error is in its log)"
        if store is None:
            return fallback
        try:
            store.set(_ALIVE + str(dist.get_rank()), "1")
            deadline = time.monotonic() + ENDED_WAIT_S
            while not store.check([_FIRST]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if store.check([_FIRST]):
                return store.get(_FIRST).decode()
            gone = [r for r in range(dist.get_world_size()) if not store.check([_ALIVE + str(r)])]
            names = [f"rank {r} ({store.get(_WHO + str(r)).decode()})" for r in gone if store.check([_WHO + str(r)])]
        except (RuntimeError, dist.DistError):
            return fallback
        if not names:
            return fallback
        return (
            f"{', '.join(names)} ended first without an error of its own: killed (SIGKILL: the "
            "out-of-memory killer, a lost node) or exited; torchrun's log on that machine gives its exit code or signal"
        )

    def _missing_ranks(self) -> list[int]:
        """Ranks that do not reach a monitored barrier on the side group (rank 0 can tell)."""
        if self._monitor is None:
            return []
        wait = datetime.timedelta(seconds=max(2.0, min(10.0, 0.1 * self.cfg.timeout_s)))
        try:
            dist.monitored_barrier(group=self._monitor, timeout=wait, wait_all_ranks=True)
        except RuntimeError as exc:
            return sorted({int(r) for found in _MISSING_RANKS.findall(str(exc)) for r in found.split(",") if r.strip()})
        return []

    def close(self) -> None:
        """Destroy the group if this object created it (every exit path calls this)."""
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
        self.owned, self._monitor = False, None


_GENERATION, _CURRENT = "torchkeel/generation", "torchkeel/current"


def round_store(store: dist.Store, rank: int) -> dist.Store:
    """A namespace of ``store`` that only this round of workers uses.

    torchrun keeps one store for the whole job (the agents' shared TCPStore), so a restarted
    worker would read the addresses the workers of the previous round left there. Its restart
    count does not tell the rounds apart across machines: an agent that restarts its workers
    because another node came back does not count a restart. So rank 0 numbers the round and
    publishes it; the others wait for the number, which ``end_round`` removes once every rank
    has joined, so that no later worker reads it stale.
    """
    if rank == 0:
        generation = store.add(_GENERATION, 1)
        store.set(_CURRENT, str(generation))
    else:
        generation = int(store.get(_CURRENT))  # blocks until rank 0 of this round has published it
    return dist.PrefixStore(f"torchkeel/round-{generation}", store)


def end_round(store: dist.Store, rank: int) -> None:
    """Once every rank has joined the process group of this round, its number goes (call on every rank)."""
    dist.barrier()
    if rank == 0:
        store.delete_key(_CURRENT)


def _is_comm_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(
        s in text
        for s in (
            "timed out",
            "timeout",
            "connection closed",
            "connection reset",
            "watchdog caught collective operation",
        )
    )
