"""A real one-node Slurm cluster (Debian's slurm-wlm and munge), started in the foreground by a test.

munged, slurmctld and slurmd run from a temporary directory with their own sockets, ports and
state, on 127.0.0.1, and are stopped by their PIDs at the end. Where Slurm is not installed the
tests that need it are skipped, saying so (install: ``apt-get install slurm-wlm munge``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "sinfo", "scancel")
MUNGE_KEY = Path("/etc/munge/munge.key")


def missing() -> list[str]:
    found = [d for d in DAEMONS if shutil.which(d) or Path("/usr/sbin", d).exists()]
    return [d for d in DAEMONS if d not in found] + ([] if MUNGE_KEY.exists() else [str(MUNGE_KEY)])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


CONF = """ClusterName=keeltest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@contextmanager
def slurm_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and slurmd; yield the environment that talks to them."""
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    host = socket.gethostname()
    conf.write_text(CONF.format(host=host, root=root, ctld_port=_port(), d_port=_port(), cpus=os.cpu_count() or 1))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munge = [
        _binary("munged"),
        "--foreground",
        "--force",
        f"--socket={root}/munge.socket",
        f"--pid-file={root}/munged.pid",
        f"--log-file={root}/munged.log",
        f"--seed-file={root}/munged.seed",
    ]
    started: list[subprocess.Popen] = []
    try:
        for command in (
            munge,
            [_binary("slurmctld"), "-D", "-f", str(conf)],
            [_binary("slurmd"), "-D", "-f", str(conf)],
        ):
            log = open(root / f"{Path(command[0]).name}.out", "w")
            started.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"Slurm did not come up: {(root / 'slurmctld.log').read_text()[-2000:]}")
        yield env
    finally:
        for process in reversed(started):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def job_state(job: str, env: dict[str, str]) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, Restarts, ...)."""
    text = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
