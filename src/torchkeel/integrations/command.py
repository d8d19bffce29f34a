"""The Trainer a command starts: ``keel train`` in this process, and each Ray worker's.

The one place the test seams of ``torchkeel.testing`` reach a Trainer (``hooks_from_env``), so
that the commands' own tests can inject faults into a run started as a user starts it.
"""

from __future__ import annotations

from typing import Any

from torchkeel.config.schema import KeelConfig
from torchkeel.testing import hooks_from_env
from torchkeel.train.trainer import Trainer


def command_trainer(config: KeelConfig, **options: Any) -> Trainer:
    """``Trainer(config, **options)`` with the faults the environment names, if any."""
    return Trainer(config, hooks=hooks_from_env(), **options)
