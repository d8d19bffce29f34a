"""Invariants of a healthy training run, checked whatever the fault.

The named findings (``diagnose.detectors``) each recognise one known fault. An invariant is a
property every healthy run satisfies (the loss's arguments agree in shape, each update is a small
fraction of its weights, a layer's units differ, the loss leaves chance level, generators do not
repeat, validation samples are not training samples); when one breaks and no named finding
explains it, the report says what broke, with the tensor, module, line and step (an
``invariant-*`` finding), so that a fault of a kind nobody wrote a detector for is still located.

Each family is one module with the same parts:

- ``Listener``: built by the probe with the probe (``Listener(probe)``); handles probe events
  (``on_<event>``, ``probe.state.EVENTS``), may ``install()`` hooks (run only in a full run, not the
  reproducibility run) and ``finish()`` at the end, and writes plain data into
  ``probe.facts.invariants[<family>]``.
- ``IDS``: its finding ids, most likely root cause first.
- ``DETECTORS``: functions ``(facts, outcome) -> list[Finding]``.
- ``EXPLAINED_BY``: finding id → the named finding ids that explain it (``ANY``: any named error
  or warning). An invariant finding a named one explains is dropped: it is that fault's symptom.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchkeel.diagnose.findings import Finding
from torchkeel.diagnose.invariants import (
    batches,
    data,
    depth,
    descent,
    dropout,
    inputs,
    losses,
    modes,
    optimizers,
    randomness,
    rows,
    units,
    updates,
)
from torchkeel.diagnose.invariants.common import ANY, ANY_CAUSE, SYMPTOMS

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.facts import Facts

FAMILIES = (data, batches, inputs, modes, losses, rows, randomness, updates, descent, optimizers, dropout, depth, units)
INVARIANT_IDS: tuple[str, ...] = tuple(i for family in FAMILIES for i in family.IDS)
LISTENERS = tuple(family.Listener for family in FAMILIES)


def judge_invariants(facts: Facts, outcome: object, named: list[Finding]) -> list[Finding]:
    """The invariant findings that no named finding (``named``) explains."""
    alarms = {f.id for f in named if f.severity in ("error", "warning") and not f.id.startswith("invariant-")}
    found: list[tuple[Finding, set[str]]] = []
    for family in FAMILIES:
        for detect in family.DETECTORS:
            for finding in detect(facts, outcome):
                explained_by = family.EXPLAINED_BY.get(finding.id, set())
                if alarms and (ANY in explained_by or ANY_CAUSE in explained_by or alarms & explained_by):
                    continue
                found.append((finding, explained_by))
    causes = {f.id for f, _ in found if f.severity in ("error", "warning") and f.id not in SYMPTOMS}
    return [f for f, by in found if not (ANY_CAUSE in by and causes - {f.id})]


__all__ = ["ANY", "ANY_CAUSE", "FAMILIES", "INVARIANT_IDS", "LISTENERS", "judge_invariants"]
