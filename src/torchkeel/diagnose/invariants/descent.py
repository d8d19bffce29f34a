"""Invariants: descent (see ``diagnose.invariants``).

Training descends its loss: the weights move against the gradient the backward gave them. Plain
SGD moves exactly against it (cosine −1), momentum and Adam nearly so (negative cosines); a step
that moves along it climbs the loss (a sign flipped in a hand-written update, ``p.data += lr *
p.grad``). At sampled steps the weights and their gradients are copied after a backward (at most
``_MAX_ELEMENTS`` values; sampled by backward passes, as a hand-written update steps no optimizer) and
compared with the weights at the next backward: the cosine between the
move and the gradient. Scripts with several optimizers (a GAN's players climb each other's losses)
are not judged.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

import torch

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.diagnose.invariants.updates import is_sampled
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "descent"
_MAX_ELEMENTS = 20_000_000
_MIN_PAIRS = 3
_ASCENT = 0.3  # the median cosine between a move and its gradient above this: the steps climb


class Listener:
    """Weights and gradients after a sampled backward, against the weights at the next one."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.snapshot: tuple[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None = None
        self.pairs: list[dict[str, Any]] = []

    def on_backward_done(self, roots: list[torch.Tensor]) -> None:
        probe = self.probe
        if probe.light or probe.state.in_step:
            return
        count = probe.facts.backward_calls  # the clock: a hand-written update has no optimizer steps
        if self.snapshot is not None and self.snapshot[0] != count:
            self._compare(*self.snapshot)
            self.snapshot = None
        if self.snapshot is None and is_sampled(count) and len(self.pairs) < 64:
            self.snapshot = (count, self._copies())

    def _copies(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        copies, size = [], 0
        for root, _ in self.probe.state.roots.values():
            for p in root.parameters():
                if p.grad is None or p.grad.is_sparse or p.is_meta or size + p.numel() > _MAX_ELEMENTS:
                    continue
                size += p.numel()
                copies.append((p, p.detach().clone(), p.grad.detach().clone()))
        return copies

    def _compare(self, step: int, copies: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        if not copies:
            return
        with torch.no_grad():
            dot = moved = grad = 0.0
            for p, w, g in copies:
                delta = (p.detach() - w).double().reshape(-1)
                g = g.double().reshape(-1)
                dot += float(delta @ g)
                moved += float(delta @ delta)
                grad += float(g @ g)
        if moved > 0 and grad > 0:
            cosine = dot / (moved**0.5 * grad**0.5)
            self.pairs.append({"backward": step, "cosine": cosine, **site_fields(user_site() or {})})

    def finish(self) -> None:
        self.probe.facts.invariants[FAMILY] = {"pairs": self.pairs}


def updates_ascend(facts: Any, outcome: object) -> list[Finding]:
    pairs = (facts.invariants.get(FAMILY) or {}).get("pairs", [])
    if len(pairs) < _MIN_PAIRS or len(facts.optimizers) > 1:
        return []
    median = statistics.median(p["cosine"] for p in pairs)
    if median <= _ASCENT:
        return []
    first = pairs[0]
    message = (
        f"the weights move along their gradient, not against it: the cosine between each step's move and the "
        f"gradient before it has a median of {median:.2f} over {len(pairs)} sampled steps (descent gives a negative "
        "one; plain SGD −1): every step climbs the loss"
    )
    evidence = {
        "median_cosine": round(median, 4),
        "pairs": len(pairs),
        "cosines": [round(p["cosine"], 4) for p in pairs[:8]],
        "threshold": _ASCENT,
        "backward": first["backward"],
        **site_fields(first),
    }
    fix = "subtract the gradient in a hand-written update (p.data -= lr * p.grad), and give optimizers a positive lr"
    return [Finding("invariant-updates-ascend", "warning", message, evidence, fix)]


IDS: tuple[str, ...] = ("invariant-updates-ascend",)
DETECTORS: tuple = (updates_ascend,)
EXPLAINED_BY: dict[str, set[str]] = {"invariant-updates-ascend": set()}
