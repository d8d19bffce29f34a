"""What ``keel diagnose`` and ``keel lint`` report: findings with a fixed vocabulary of ids.

A finding names one failure (``id``), how sure the tool is (``severity``: ``error`` when the
evidence shows the fault, ``warning`` when it very likely is one, ``info`` when it is only
suspicious), what was seen (``evidence``: plain JSON data) and one sentence saying what to do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SEVERITIES = ("error", "warning", "info")

# Every runtime finding id, most likely root cause first. Ordering findings by this list puts
# the cause before its consequences (NaN in the batch before the module that propagated it,
# a missing zero_grad before the gradients it made explode). Ids are never renamed.
FINDING_IDS = (
    "nonfinite-input",
    "label-out-of-range",
    "batchnorm-batch-one",
    "unshuffled-ordered-labels",
    "inplace-modified",
    "repeated-backward",
    "double-step",
    "zero-grad-before-step",
    "clip-before-backward",
    "missing-zero-grad",
    "accumulation-not-averaged",
    "params-not-updating",
    "frozen-parameters",
    "grad-none",
    "scheduler-cadence",
    "input-scale",
    "lr-divergence",
    "grad-exploding",
    "nonfinite-forward",
    "nonfinite-grad",
    "grad-vanishing",
    "softmax-over-batch",
    "probabilities-into-cross-entropy",
    "train-mode-not-restored",
    "eval-in-train-mode",
    "dropout-always-on",
    "leaked-graph",
    "nondeterministic",
    "generator-in-workers",
    "augmentation-in-evaluation",
    "dataloader-bottleneck",
    "scheduler-before-optimizer",
    # Invariants of a healthy run (diagnose.invariants): reported when no named finding explains
    # them. Causes before symptoms: what the data, the loss's arguments, the generators, the updates
    # and the units show, then how the loss moves.
    # -- invariants: data
    "invariant-identical-inputs",
    "invariant-labels-change",
    "invariant-labels-uninformative",
    "invariant-one-class",
    "invariant-eval-overlaps-train",
    # -- invariants: batches
    "invariant-batch-repeats",
    "invariant-targets-in-inputs",
    "invariant-inputs-tiny",
    # -- invariants: inputs
    "invariant-eval-inputs-shifted",
    # -- invariants: modes
    "invariant-trains-in-eval-mode",
    # -- invariants: losses
    "invariant-loss-targets-are-inputs",
    "invariant-loss-counts-padding",
    "invariant-loss-negated",
    "invariant-loss-unbounded",
    "invariant-loss-broadcast",
    "invariant-loss-target-range",
    # -- invariants: rows
    "invariant-rows-mixed",
    "invariant-input-ignored",
    "invariant-order-ignored",
    # -- invariants: randomness
    "invariant-rng-reset",
    "invariant-rng-recreated",
    # -- invariants: optimizers' settings (they make the updates: ranked before them)
    "invariant-grads-discarded",
    "invariant-optimizer-recreated",
    "invariant-optimizer-settings",
    # -- invariants: descent
    "invariant-updates-ascend",
    # -- invariants: updates
    "invariant-clip-always",
    "invariant-update-too-small",
    "invariant-update-too-large",
    # -- invariants: optimizers
    "invariant-grads-not-stepped",
    "invariant-grads-zero",
    "invariant-weights-collapse",
    "invariant-decay-dominates",
    # -- invariants: dropout
    "invariant-dropout-drops-most",
    # -- invariants: depth
    "invariant-init-scale",
    "invariant-linear-stack",
    # -- invariants: units
    "invariant-units-identical",
    "invariant-units-dead",
    # -- invariants: how the loss moves, a symptom of most faults above: ranked after every other invariant
    "invariant-loss-too-fast",
    "invariant-loss-at-chance",
    "graph-break",
    "recompile",
    "script-error",
)


@dataclasses.dataclass
class Finding:
    """One diagnosed failure. ``evidence`` holds only JSON-serialisable values."""

    id: str
    severity: str
    message: str
    evidence: dict[str, Any]
    fix: str

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def order_findings(findings: list[Finding]) -> list[Finding]:
    """Most likely root cause first: errors before warnings before info, then the id order."""
    rank = {name: i for i, name in enumerate(FINDING_IDS)}
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), rank.get(f.id, len(rank))))


def where_text(event: dict[str, Any]) -> str:
    return f" at {event['file']}:{event['line']}" if event.get("file") else ""


def site_fields(event: dict[str, Any]) -> dict[str, Any]:
    return {k: event[k] for k in ("file", "line") if event.get(k) is not None}


def forward_op_of(backward_op: str | None) -> str | None:
    if not backward_op:
        return None
    name = backward_op.rstrip("0123456789")
    return name[: -len("Backward")].lower() if name.endswith("Backward") else name
