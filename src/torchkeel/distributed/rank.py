"""Rank information read from the environment that ``torchrun`` sets.

Every component that writes shared files asks ``RankInfo.is_main`` first, so that a run under
``torchrun`` writes each file once, from rank 0, even before distributed training is wired in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


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
        """Read ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` as ``torchrun`` sets them; defaults: one process."""
        env = os.environ if environ is None else environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
        )
