"""An sbatch script that runs ``keel train`` on several Slurm nodes through torchrun.

Slurm allocates the nodes and starts one task per node (``srun``); each task is a torchrun agent
that meets the others at a c10d rendezvous on the first node and starts the node's workers. Nothing
here launches or rendezvouses on its own: the script only wires Slurm's variables into torchrun's
flags, and the signals that reach the batch shell into the job step:

1. ``--signal=B:USR1@S`` makes Slurm signal the batch shell S seconds before the time limit
   (``scancel --batch`` signals it too); the shell passes the signal to the job step.
   ``scancel --signal=TERM`` without ``--batch`` and a preemption signal the step directly;
2. torchrun (``--signals-to-handle``) passes it to every worker; the Trainer saves a checkpoint and
   exits 143 (SIGUSR1 counts as SIGTERM), and its rank 0 asks Slurm to requeue the job
   (:mod:`torchkeel.cluster.requeue`): the script itself never requeues, so a job is requeued once;
3. torchrun ends with one line and the same 143 (:mod:`torchkeel.cluster.torchrun`), and so does
   the script: a stopped run ends requeued (or FAILED when the requeue fails), never COMPLETED.
   The requeued job starts again with ``--resume auto`` from that checkpoint.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from torchkeel.errors import ConfigError

_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass
class SlurmJob:
    """What ``keel slurm`` asks Slurm for, and what each node runs."""

    config: str
    """The YAML config, as the job's nodes see it (an absolute path on a shared filesystem)."""
    nodes: int
    gpus_per_node: int
    time: str
    """``HH:MM:SS`` or ``D-HH:MM:SS``."""
    name: str = "keel"
    partition: str | None = None
    account: str | None = None
    overrides: list[str] = field(default_factory=list)
    nproc_per_node: int | None = None
    """Workers per node; the GPUs per node by default (1 on CPU nodes)."""
    warn_s: int = 120
    """Seconds before the time limit at which training stops with a checkpoint."""
    join_timeout_s: int = 600
    """How long the nodes wait for each other at the rendezvous before the job fails."""
    max_restarts: int = 3
    """Worker failures torchrun recovers from (every node's workers restart from the checkpoint)."""
    cpus_per_node: int | None = None
    """CPUs of the node's one task; none: the whole node (``--exclusive``), all its CPUs to the task."""
    requeue: bool = True
    """Whether rank 0 requeues the job after a stop (``#SBATCH --requeue``); ``False``: ``--no-requeue``."""
    chdir: str = field(default_factory=os.getcwd)
    """The job's working directory (``--chdir``): imports and relative paths as where it was written."""
    bin_dir: str = field(default_factory=lambda: str(Path(sys.executable).parent))
    """Where ``torchrun`` and ``keel`` are installed on the nodes (this environment's by default)."""

    def validate(self) -> "SlurmJob":
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if not _TIME.match(self.time):
            raise ConfigError(f"--time {self.time!r} is not HH:MM:SS or D-HH:MM:SS (e.g. --time 04:00:00)")
        if self.warn_s < 10:
            raise ConfigError(f"--warn-s must leave time to save a checkpoint (>= 10 s), got {self.warn_s}")
        if self.warn_s >= _seconds(self.time):
            raise ConfigError(f"--warn-s {self.warn_s} is not shorter than --time {self.time}")
        if not _NAME.match(self.name):
            raise ConfigError(f"job name {self.name!r} may hold only letters, digits, '.', '_' and '-'")
        return self

    @property
    def workers_per_node(self) -> int:
        return self.nproc_per_node or max(self.gpus_per_node, 1)


def sbatch_script(job: SlurmJob) -> str:
    """The text of the sbatch script for ``job``."""
    job.validate()
    q = shlex.quote
    head, cpus = _directives(job)
    torchrun = _torchrun(job)
    continued = " \\\n    ".join(torchrun)
    then = "which saves a checkpoint; rank 0 then requeues the job" if job.requeue else "which saves a checkpoint"
    body = f"""
set -uo pipefail
KEEL_BIN=${{KEEL_BIN:-{q(job.bin_dir)}}}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 20000))
echo "keel slurm: job $SLURM_JOB_ID (start ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_NNODES node(s), rendezvous $head_node:$port"

# Slurm's warning (--signal=B:USR1@S) and `scancel --batch` signal this shell, not the job step.
on_warning() {{
    echo "keel slurm: time limit in {job.warn_s} s: passing SIGUSR1 to the job step, {then}"
    kill -USR1 "$step" 2>/dev/null
}}
# Preemption (PreemptMode=CANCEL) and scancel signal this shell and the step with SIGTERM, then
# SIGKILL after KillWait (30 s by default): the save must fit in it.
on_term() {{
    echo "keel slurm: SIGTERM: passing it to the job step, {then}"
    kill -TERM "$step" 2>/dev/null
}}
trap on_warning USR1
trap on_term TERM

srun --ntasks-per-node=1 {cpus} --kill-on-bad-exit=1 \\
    {continued} &
step=$!
wait "$step"
status=$?
# A trapped signal ends `wait` early: wait until the job step itself has ended.
while kill -0 "$step" 2>/dev/null; do
    wait "$step"
    status=$?
done
# A step stopped before the run finished exits 143: the job ends requeued or FAILED, never COMPLETED.
exit "$status"
"""
    return "\n".join(head) + "\n" + body


def _directives(job: SlurmJob) -> tuple[list[str], str]:
    """The script's ``#SBATCH`` lines, and the ``--cpus-per-task`` its srun line repeats."""
    q = shlex.quote
    head = [
        "#!/bin/bash",
        f"# Written by keel slurm for {job.config}: {job.nodes} node(s) x {job.workers_per_node} worker(s).",
        "# Submit it with sbatch; a requeued job continues from its newest checkpoint (--resume auto).",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if job.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    # Slurm >= 22.05 does not pass --cpus-per-task from sbatch on to srun: the srun line says it again.
    if job.cpus_per_node:
        head.append(f"#SBATCH --cpus-per-task={job.cpus_per_node}")
        cpus = '--cpus-per-task="$SLURM_CPUS_PER_TASK"'
    else:
        head.append("#SBATCH --exclusive")
        cpus = '--cpus-per-task="$SLURM_CPUS_ON_NODE"'
    head += [f"#SBATCH --chdir={q(job.chdir)}", f"#SBATCH --time={job.time}"]
    head += [f"#SBATCH --partition={job.partition}"] if job.partition else []
    head += [f"#SBATCH --account={job.account}"] if job.account else []
    head += [
        f"#SBATCH --signal=B:USR1@{job.warn_s}",
        "#SBATCH --requeue" if job.requeue else "#SBATCH --no-requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={job.name}-%j.out",
    ]
    return head, cpus


def _torchrun(job: SlurmJob) -> list[str]:
    """The torchrun command each node's task runs, one argument group a line."""
    q = shlex.quote
    return [
        # torchrun itself, ending with one line and exit 0 when it stopped the workers for a signal.
        '"$KEEL_BIN/python3" -m torchkeel.cluster.torchrun',
        '--nnodes "$SLURM_NNODES"',
        f"--nproc-per-node {job.workers_per_node}",
        "--rdzv-backend c10d",
        '--rdzv-endpoint "$head_node:$port"',
        '--rdzv-id "$SLURM_JOB_ID"',
        f"--rdzv-conf join_timeout={job.join_timeout_s}",
        f"--max-restarts {job.max_restarts}",
        "--signals-to-handle SIGTERM,SIGINT,SIGUSR1",
        # torchrun kills workers this long after passing on the signal: they need the time to save.
        f"--shutdown-timeout {max(job.warn_s - 10, 10)}",
        '--no-python "$KEEL_BIN/keel" train',
        q(job.config),
        "--resume auto --no-progress" + ("" if job.requeue else " --no-requeue"),
        *(q(o) for o in job.overrides),
    ]


def _seconds(limit: str) -> int:
    days, _, clock = limit.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s
