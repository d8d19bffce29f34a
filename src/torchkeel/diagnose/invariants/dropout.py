"""Invariants: dropout (see ``diagnose.invariants``).

A healthy run's dropout keeps most of the signal it regularises: each training call of a dropout
(``nn.Dropout*`` or ``F.dropout*``) zeroes at most 80 % of its input. Srivastava et al. (2014, JMLR)
keep 0.5 of hidden units and 0.8 of inputs, and their error rises steeply as fewer than one unit
in five is kept; a layer that passes on a tenth of its activations (``p=0.9``, often a keep
probability written where a drop probability is meant) starves everything after it.

The listener chains a check onto the dropout functions the probe's function mode already sees
(``nn.Dropout`` calls them); the check reads the call's ``p`` and ``training``, nothing per element.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.diagnose.invariants.common import chained
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "dropout"
_MAX_DROP = 0.8
_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)
_ARGUMENTS = ("input", "p", "training", "inplace")


class Listener:
    """The first training call of each dropout that drops more than ``_MAX_DROP`` of its input."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.found: dict[str, dict[str, Any]] = {}

    def install(self) -> None:
        checks = self.probe.modules.loss_checks
        for func in _DROPOUTS:
            checks[func] = chained(checks.get(func), self.check)

    def check(self, func: Callable, args: Any, kwargs: dict) -> None:
        bound = {**dict(zip(_ARGUMENTS, args)), **kwargs}
        p, training = bound.get("p", 0.5), bound.get("training", True)
        if training is not True or not isinstance(p, (int, float)) or p <= _MAX_DROP or not torch.is_grad_enabled():
            return
        stack = self.probe.state.module_stack
        module = self.probe.name_of(stack[-1]) if stack else None
        site = user_site() or {}
        key = f"{module}:{site.get('file')}:{site.get('line')}"
        if key not in self.found and len(self.found) < 8:
            self.found[key] = {
                "step": self.probe.next_step,
                "call": f"F.{func.__name__}",
                "module": module,
                "p": float(p),
                **site_fields(site),
            }

    def finish(self) -> None:
        self.probe.facts.invariants[FAMILY] = {"dropouts": list(self.found.values())}


def drops_most(facts: Any, outcome: object) -> list[Finding]:
    dropouts = (facts.invariants.get(FAMILY) or {}).get("dropouts", [])
    if not dropouts:
        return []
    d = dropouts[0]
    site = f"{d['file']}:{d['line']}" if d.get("file") else None
    where = " at ".join(w for w in (d["module"], site) if w)
    message = (
        f"{d['call']} in {where} drops p={d['p']:g} of its input at every training step (from step {d['step']}): "
        f"it passes on {1 - d['p']:.0%} of the activations, and what follows learns from almost nothing"
    )
    evidence = {**d, "dropouts": dropouts, "threshold": _MAX_DROP}
    fix = (
        "p is the probability to drop, not to keep: use p=0.1..0.5 for hidden layers (0.2 for inputs); "
        f"p={1 - d['p']:.2g} keeps what p={d['p']:g} was meant to"
    )
    return [Finding("invariant-dropout-drops-most", "warning", message, evidence, fix)]


IDS: tuple[str, ...] = ("invariant-dropout-drops-most",)
DETECTORS: tuple = (drops_most,)
EXPLAINED_BY: dict[str, set[str]] = {"invariant-dropout-drops-most": {"dropout-always-on"}}
