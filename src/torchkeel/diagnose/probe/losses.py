"""The arguments of the losses, checked before the call: class targets out of range, a
cross entropy over a one-unit output, probabilities (a softmax's output) where logits belong.

The function mode hands over each call of ``F.cross_entropy``/``F.nll_loss`` and the binary
cross entropies (their modules call them); the class targets also go to the habits listener
(classes that arrive in order) and their rows to the scale listener (what a batch is)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from torchkeel.diagnose.events import LabelOutOfRange, OneUnitCrossEntropy, ProbabilitiesIntoCrossEntropy
from torchkeel.diagnose.tracing import forward_site
from torchkeel.introspect.sites import site_text, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe


class LossListener:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def checks(self) -> dict[Callable, Callable]:
        return {
            F.cross_entropy: self.check_classification,
            F.nll_loss: self.check_classification,
            F.binary_cross_entropy: self.check_binary,
            F.binary_cross_entropy_with_logits: self.check_binary,
        }

    def check_classification(self, func: Callable, args: Any, kwargs: dict) -> None:
        names = ("input", "target", "weight", "size_average", "ignore_index")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        logits, target = bound.get("input"), bound.get("target")
        if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor) or logits.dim() < 1:
            return
        probe = self.probe
        site, loss, step = user_site() or {}, func.__name__, probe.next_step
        num_classes = logits.shape[1] if logits.dim() >= 2 else logits.shape[0]
        probe.emit("loss_targets", target)
        if num_classes == 1 and func is F.cross_entropy and not probe.facts.events.get("one-unit-cross-entropy"):
            probe.record(
                "one-unit-cross-entropy",
                OneUnitCrossEntropy(step=step, loss=loss, shape=list(logits.shape), **site),
            )
        if not target.is_floating_point() and target.numel():
            valid = target[target != bound.get("ignore_index", -100)]
            if valid.numel():
                low, high = int(valid.min()), int(valid.max())
                if low < 0 or high >= num_classes:
                    bad = valid[(valid < 0) | (valid >= num_classes)]
                    probe.record(
                        "label-out-of-range",
                        LabelOutOfRange(
                            loss=loss,
                            value=high if high >= num_classes else low,
                            num_classes=int(num_classes),
                            num_bad_targets=int(bad.numel()),
                            min_target=low,
                            max_target=high,
                            step=step,
                            **site,
                        ),
                    )
        if (
            logits.dim() >= 2
            and logits.is_floating_point()
            and not probe.facts.events.get("probabilities-into-cross-entropy")
        ):
            x = logits.detach()
            if x.shape[1] > 1 and bool((x >= 0).all()) and float((x.sum(dim=1) - 1).abs().max()) < 1e-3:
                producer = type(logits.grad_fn).__name__ if logits.grad_fn is not None else None
                probe.record(
                    "probabilities-into-cross-entropy",
                    ProbabilitiesIntoCrossEntropy(
                        loss=loss,
                        rows=int(x.shape[0]),
                        num_classes=int(x.shape[1]),
                        max_row_sum_error=float((x.sum(dim=1) - 1).abs().max()),
                        produced_by=producer,
                        step=step,
                        loss_at=site_text(site or None),
                        **(_made_at(logits) or site),
                    ),
                )

    def check_binary(self, func: Callable, args: Any, kwargs: dict) -> None:
        bound = dict(zip(("input", "target"), args))
        bound.update(kwargs)
        x, target = bound.get("input"), bound.get("target")
        if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor) or not target.numel():
            return
        probe = self.probe
        site, step = user_site() or {}, probe.next_step
        low, high = float(target.min()), float(target.max())
        if low < 0 or high > 1:
            probe.record(
                "label-out-of-range",
                LabelOutOfRange(
                    loss=func.__name__,
                    value=high if high > 1 else low,
                    num_classes=2,
                    min_target=low,
                    max_target=high,
                    num_bad_targets=int(((target < 0) | (target > 1)).sum()),
                    step=step,
                    **site,
                ),
            )
        producer = type(x.grad_fn).__name__ if x.grad_fn is not None else None
        if func is F.binary_cross_entropy_with_logits and producer and "Sigmoid" in producer:
            probe.record(
                "probabilities-into-cross-entropy",
                ProbabilitiesIntoCrossEntropy(
                    loss=func.__name__,
                    rows=int(x.shape[0]) if x.dim() else 1,
                    num_classes=2,
                    max_row_sum_error=None,
                    produced_by=producer,
                    step=step,
                    **site,
                ),
            )


def _made_at(t: torch.Tensor) -> dict[str, Any]:
    """The user's line that made ``t`` (its softmax, say), from anomaly mode's forward stack."""
    node = t.grad_fn
    trace = node.metadata.get("traceback_") if node is not None and hasattr(node, "metadata") else None
    return forward_site(trace) if trace else {}
