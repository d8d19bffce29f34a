"""Rank information read from the environment that ``torchrun`` sets.

Every component that writes shared files asks ``RankInfo.is_main`` first, so that a run under
``torchrun`` writes each file once, from rank 0, even before distributed training is wired in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from torchkeel.errors import ConfigError


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job: global rank, number of processes, rank on this node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """True on the one process that writes shared files (rank 0)."""
        return self.rank == 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RankInfo":
        """Read ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` as ``torchrun`` sets them; defaults: one process.

        Raises:
            ConfigError: the variables count pods, not processes (a PyTorchJob's, with several
                processes per pod, read without torchrun in between).
        """
        env = os.environ if environ is None else environ
        per_pod = env.get("PET_NPROC_PER_NODE", "1")
        if "WORLD_SIZE" in env and "LOCAL_RANK" not in env and per_pod not in ("1", "auto"):
            raise ConfigError(
                f"WORLD_SIZE={env['WORLD_SIZE']} and RANK={env.get('RANK', '0')} count pods here (a PyTorchJob "
                f"with PET_NPROC_PER_NODE={per_pod}), not processes: start keel under torchrun "
                "(torchrun --nnodes=$(WORLD_SIZE) --node-rank=$(RANK) ... --no-python keel train ..., "
                "as keel k8s train --kind pytorchjob writes it)"
            )
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
        )


def per_rank(batch_size: int, world_size: int) -> int:
    """Each rank's share of the job's batch ``batch_size``.

    Raises:
        ConfigError: the batch does not divide by the world size (both numbers named).
    """
    if batch_size % world_size:
        raise ConfigError(
            f"train.batch_size {batch_size} does not divide by the world size {world_size}; "
            f"use a multiple of {world_size} (it is the batch of the whole job)"
        )
    return batch_size // world_size
