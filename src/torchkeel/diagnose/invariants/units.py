"""Invariants: units (see ``diagnose.invariants``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "units"
IDS: tuple[str, ...] = ()
DETECTORS: tuple = ()
EXPLAINED_BY: dict[str, set[str]] = {}


class Listener:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe
