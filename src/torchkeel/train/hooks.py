"""The seams tests and fault injection reach the Trainer through, kept out of the training API.

A real run passes none (``torchkeel.testing.hooks_from_env()`` makes them from environment
variables for the commands' own tests); nothing here is in ``torchkeel.__all__``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchkeel.checkpoint.format import PointHook
from torchkeel.train.memory import MemoryReader


@dataclass(frozen=True)
class TrainerHooks:
    """What ``Trainer(hooks=)`` and ``StepSettings(hooks=)`` call at their seams.

    ``checkpoint(point)`` runs at each named point of a checkpoint write (a kill there tests
    atomicity); ``before_forward(num_samples)`` before each forward piece of a step (an injected
    out-of-memory error, a stall, a kill); ``memory`` is where memory figures come from (a fake
    plays a CUDA machine on a CPU).
    """

    checkpoint: PointHook | None = None
    before_forward: Callable[[int], None] | None = None
    memory: MemoryReader | None = None
