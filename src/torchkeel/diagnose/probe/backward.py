"""Backward passes: a wrapper of ``torch.autograd.backward`` that reads the loss, traces where
gradients go non-finite, and explains the errors backward raises (in-place changes, a graph used
twice, a loss without a graph)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchkeel.diagnose.census import census
from torchkeel.diagnose.events import GraphReused, InplaceModified, LossWithoutGraph, NonfiniteGrad, NonfiniteLoss
from torchkeel.diagnose.tracing import GradTracer, forward_site
from torchkeel.inspect.graph import graph_nodes
from torchkeel.inspect.sites import display_path, is_nonfinite, tensors_in, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

_ORIGINAL_BACKWARD = torch.autograd.backward


class BackwardListener:
    """Wraps ``torch.autograd.backward`` (``loss.backward()`` goes through it)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def install(self) -> None:
        self.probe.patch(torch.autograd, "backward", self._backward)

    def _backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        probe, facts = self.probe, self.probe.facts
        original = _ORIGINAL_BACKWARD
        if probe.busy:
            return original(tensors, *args, **kwargs)
        light = probe.light
        roots = tensors_in(tensors)
        if not light:
            probe.track(roots)
        loss_finite = True
        if roots and roots[0].numel() == 1:
            value = float(roots[0].detach())
            loss_finite = bool(np.isfinite(value))
            facts.losses.append({"step": probe.next_step, "value": value})
        if not light:
            probe.guarded(self._before_backward, loss_finite)
        traced = facts.backward_calls < 50 or facts.backward_calls % 20 == 0
        hooks = (
            GradTracer(roots)
            if (not light and loss_finite and traced and not facts.events.get("nonfinite-grad"))
            else None
        )
        try:
            result = original(tensors, *args, **kwargs)
        except RuntimeError as exc:
            text = str(exc)
            if not light and "modified by an inplace operation" in text:
                probe.guarded(self._inplace_error, roots, exc)
            elif not light and "backward through the graph a second time" in text:
                probe.guarded(self._graph_reused, exc)
            elif not light and "does not require grad and does not have a grad_fn" in text:
                params = probe.all_params()
                probe.record(
                    "loss-without-graph",
                    LossWithoutGraph(
                        step=probe.next_step,
                        grad_enabled=torch.is_grad_enabled(),
                        num_params=len(params),
                        num_trainable=sum(p.requires_grad for p in params),
                        **(user_site() or {}),
                    ),
                )
            raise
        finally:
            if hooks is not None:
                hooks.remove()
        facts.backward_calls += 1
        if facts.backward_calls == 4 * probe.anomaly_steps and not light:
            torch.autograd.set_detect_anomaly(False)  # a script that rarely steps: stop recording stacks
        probe.optim.backward_done()
        if not light and loss_finite and not facts.events.get("nonfinite-grad"):
            probe.guarded(self._check_grads, hooks)
        return result

    def _before_backward(self, loss_finite: bool) -> None:
        probe = self.probe
        if not loss_finite:
            probe.modules.scan_calls()
            probe.record(
                "nonfinite-loss", NonfiniteLoss(step=probe.next_step, op=probe.step_nonfinite_op, site=user_site())
            )
            probe.watch_ops = False

    def _check_grads(self, tracer: GradTracer | None) -> None:
        probe = self.probe
        params = probe.all_params()
        grads = [p.grad for p in params if p.grad is not None and p.grad.is_floating_point()]
        if not grads or bool(torch.stack(torch._foreach_norm(grads)).isfinite().all()):
            return  # one fused check; a norm that overflows (huge but finite) is sorted out below
        bad = [p for p in params if p.grad is not None and is_nonfinite(p.grad)]
        if not bad:
            return
        names, owners = probe.param_names(), probe.owner_of()
        modules: list[str] = []
        for p in bad:
            owner = owners.get(id(p))
            if owner is not None and probe.name_of(owner) not in modules:
                modules.append(probe.name_of(owner))
        probe.record(
            "nonfinite-grad",
            NonfiniteGrad(
                step=probe.next_step,
                parameters=[names.get(id(p), "?") for p in bad][:10],
                num_parameters=len(bad),
                modules=modules[:10],
                backward_op=tracer.found if tracer else None,
            ),
        )

    def _inplace_error(self, roots: list[torch.Tensor], exc: RuntimeError) -> None:
        message = str(exc).split("\n")[0]
        culprit: dict[str, Any] | None = None
        for node in graph_nodes([r.grad_fn for r in roots if r.grad_fn is not None], limit=20000):
            for attr in dir(node):
                if not attr.startswith("_saved_"):
                    continue
                try:
                    getattr(node, attr)
                except RuntimeError as err:
                    if "inplace" in str(err):
                        culprit = {"backward_op": type(node).__name__, "saved": attr[len("_saved_") :]}
                        trace = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
                        if trace:
                            culprit.update(forward_site(trace))
                        break
                except Exception:  # noqa: BLE001 - other accessors may refuse for other reasons
                    continue
            if culprit:
                break
        if culprit and culprit.get("function") == "forward":
            culprit["module"] = self._module_at(culprit)
        self.probe.record(
            "inplace-modified", InplaceModified(step=self.probe.next_step, error=message, **(culprit or {}))
        )

    def _graph_reused(self, exc: RuntimeError) -> None:
        """backward() reached a graph an earlier backward already freed: find the tensor from an
        earlier step that this step's graph still hangs on (a hidden state carried across steps)."""
        probe = self.probe
        found, _ = census(probe.next_step, probe.tracked, probe.last_census, want_holder=True)
        probe.record(
            "graph-reused",
            GraphReused(
                step=probe.next_step, holder=found["holder"], error=str(exc).split("\n")[0][:300], **(user_site() or {})
            ),
        )

    def _module_at(self, site: dict[str, Any]) -> str | None:
        """The module whose ``forward`` holds ``file:line``."""
        probe = self.probe
        for root, _ in probe.roots.values():
            for sub in root.modules():
                try:
                    lines, start = inspect.getsourcelines(type(sub).forward)
                    path = inspect.getsourcefile(type(sub).forward)
                except (OSError, TypeError):
                    continue
                if (
                    path
                    and display_path(path) == site.get("file")
                    and start <= site.get("line", -1) < start + len(lines)
                ):
                    return probe.name_of(sub)
        return None
