"""Is a directory the same directory on every node? Checkpoints assume it is.

A checkpoint is written by rank 0 (or in shards by every rank) and read back by every rank on
resume. When the run directory sits on a disk local to each node, rank 0's node holds the
checkpoints and the other nodes resume from nothing: the job trains from scratch without saying
so. ``check_shared_directory`` finds that out at start, with one file and two gathers.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torchkeel.errors import ConfigError

PROBE_PREFIX = ".keel-shared-"
SETTLE_S = 5.0
"""How long a rank looks for rank 0's file: a network filesystem may show a new file late."""


def spans_nodes(world_size: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the job may span several machines: torchrun's ``LOCAL_WORLD_SIZE`` is smaller than
    the world (a launcher that does not set it may span machines too)."""
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_WORLD_SIZE")
    return world_size > 1 and (local is None or int(local) < world_size)


def check_shared_directory(
    directory: Path,
    rank: int,
    all_gather: Callable[[Any], list[Any]],
    *,
    what: str = "the checkpoint directory",
    settle_s: float = SETTLE_S,
) -> None:
    """Raise ``ConfigError`` on every rank unless every rank sees the file rank 0 writes in ``directory``.

    Call it on every rank at the same point (it gathers twice). ``all_gather(value)`` returns every
    rank's value in rank order (``TrainingJob.all_gather_object``).
    """
    probe, up = None, 0
    if rank == 0:
        # The nearest directory that exists: creating the run directory here would change how
        # the run starts (an existing run directory needs --resume or --overwrite).
        up = next(i for i, p in enumerate([directory, *directory.parents]) if p.exists())
        probe = _up(directory, up) / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        probe.write_text(socket.gethostname())
    up, name = all_gather((up, probe.name if probe is not None else None))[0]
    seen = rank == 0 or _appears(_up(directory, up) / name, settle_s)
    views = all_gather((seen, socket.gethostname()))
    if probe is not None:
        probe.unlink(missing_ok=True)
    blind = [(r, host) for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        ranks = ", ".join(f"rank {r} on {host}" for r, host in blind[:4]) + (" ..." if len(blind) > 4 else "")
        raise ConfigError(
            f"{what} {directory} is not shared across the job's machines: {ranks} cannot see the file rank 0 "
            f"wrote there ({views[0][1]}); put the run directory on a filesystem every node mounts "
            "(NFS, Lustre, a ReadWriteMany volume) or set out_dir to one"
        )


def _up(directory: Path, levels: int) -> Path:
    return directory if levels == 0 else directory.parents[levels - 1]


def _appears(path: Path, settle_s: float) -> bool:
    deadline = time.monotonic() + settle_s
    while True:
        if path.exists():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
