"""Requeue a Slurm batch job from the training process that a signal stopped.

A run stopped by SIGTERM (``scancel``, a preemption) or by Slurm's warning before the time limit
(SIGUSR1, ``--signal=USR1@S``) has saved a checkpoint but has not finished. Rank 0 then asks Slurm
to put the job back in the queue (``scontrol requeue $SLURM_JOB_ID``), so that the next start
continues with ``--resume auto``. It works whatever the batch script is: the one ``keel slurm``
writes, or a user's own ``srun keel train cfg.yaml``. The process still exits 128 + the signal
(143), so a job whose requeue fails ends FAILED, never COMPLETED.

Whether to ask is :func:`plan_requeue`, a pure function of the stop signal, the rank and Slurm's
variables; :func:`requeue_job` asks. Both work from a hand-written loop::

    plan = plan_requeue(stop_signal, is_main=rank == 0, environ=os.environ)
    if plan.job_id is not None:
        failure = requeue_job(plan.job_id)
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

REQUEUE_SIGNALS = ("SIGTERM", "SIGUSR1")
"""A scheduler's stops. SIGINT is a person's Ctrl-C: the job is not requeued for it."""
SCONTROL_TIMEOUT_S = 30


@dataclass(frozen=True)
class RequeuePlan:
    """Whether to requeue: the Slurm job to requeue, or why none is."""

    job_id: str | None
    """The job ``scontrol requeue`` is asked for; ``None``: no requeue (see ``reason``)."""
    reason: str
    """Why (not): one phrase, for a log line."""


def plan_requeue(
    stop_signal: str | None, *, is_main: bool, environ: Mapping[str, str], enabled: bool = True
) -> RequeuePlan:
    """Whether this process should requeue its Slurm job after a stop for ``stop_signal``.

    Only rank 0 (``is_main``) asks, only for SIGTERM or SIGUSR1, only in a batch job (Slurm sets
    ``SLURM_JOB_ID`` and ``ENVIRONMENT=BATCH`` there and in every ``srun`` step of it; an
    ``salloc`` allocation cannot be requeued), and only when ``enabled`` (``keel train --no-requeue``).
    """
    job_id = environ.get("SLURM_JOB_ID")
    if stop_signal not in REQUEUE_SIGNALS:
        return RequeuePlan(None, f"stopped by {stop_signal or 'no signal'}, not by the scheduler")
    if not enabled:
        return RequeuePlan(None, "requeue turned off (--no-requeue)")
    if not is_main:
        return RequeuePlan(None, "rank 0 asks for the requeue")
    if not job_id:
        return RequeuePlan(None, "not a Slurm job (no SLURM_JOB_ID)")
    if environ.get("ENVIRONMENT") != "BATCH":
        return RequeuePlan(None, f"Slurm job {job_id} is an interactive allocation, not a batch job")
    return RequeuePlan(job_id, f"stopped by {stop_signal} in Slurm batch job {job_id}")


def requeue_job(job_id: str) -> str | None:
    """Run ``scontrol requeue job_id``; ``None`` when Slurm took it, else why not, in one line.

    Slurm then signals every process of the job (SIGTERM, SIGKILL ``KillWait`` seconds later).
    This process has saved and is ending, so from here on it ignores SIGTERM and SIGUSR1: they
    would only cut off its last lines.
    """
    for name in REQUEUE_SIGNALS:
        signal.signal(signal.Signals[name], signal.SIG_IGN)
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S
        )
    except FileNotFoundError:
        return "scontrol is not on PATH"
    except subprocess.TimeoutExpired:
        return f"scontrol did not answer in {SCONTROL_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    said = (done.stderr or done.stdout).strip().splitlines()
    return said[-1] if said else f"scontrol exited {done.returncode}"
