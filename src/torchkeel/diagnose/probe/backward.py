"""Backward passes: a wrapper of ``torch.autograd.backward`` that reads the loss, traces where
gradients go non-finite, and explains the errors backward raises (in-place changes, a graph used
twice, a loss without a graph)."""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchkeel.diagnose.census import census
from torchkeel.diagnose.events import (
    GraphReused,
    InplaceModified,
    LossWithoutGraph,
    NonfiniteGrad,
    NonfiniteLoss,
    RepeatedBackward,
)
from torchkeel.diagnose.tracing import GradTracer, forward_site
from torchkeel.introspect.graph import graph_nodes
from torchkeel.introspect.sites import display_path, is_nonfinite, site_text, tensors_in, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

_ORIGINAL_BACKWARD = torch.autograd.backward
_ORIGINAL_GRAD = torch.autograd.grad
_MODIFIED = re.compile(r"\[torch\.\w+ \[([\d, ]*)\]\].*?is at version (\d+)")


class BackwardListener:
    """Wraps ``torch.autograd.backward`` (``loss.backward()`` goes through it)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        # The graphs this step already ran backward through (their root nodes, held until the
        # step ends: a node cannot be weakly referenced) and where, with retain_graph or not.
        self.step_roots: list[tuple[Any, str, bool]] = []
        self.roots_step = 0
        # Root nodes of the last backward passes that freed their graph (for censuses: a live
        # tensor that reaches several of them keeps graphs across steps).
        self.recent_roots = probe.state.recent_roots

    def install(self) -> None:
        self.probe.patch(torch.autograd, "backward", self._backward)
        self.probe.patch(torch.autograd, "grad", self._grad)

    def _grad(self, outputs: Any, *args: Any, **kwargs: Any) -> Any:
        """``torch.autograd.grad`` (a gradient penalty, a closure): its errors explained like backward's."""
        try:
            return _ORIGINAL_GRAD(outputs, *args, **kwargs)
        except RuntimeError as exc:
            if not self.probe.light and not self.probe.state.busy and "modified by an inplace operation" in str(exc):
                self.probe.safely(self._inplace_error, tensors_in(outputs), exc)
            raise

    def _repeated(self, roots: list[torch.Tensor], args: tuple, kwargs: dict) -> None:
        """A second backward through the same graph in one step adds its gradients twice."""
        probe = self.probe
        if self.roots_step != probe.facts.steps:
            self.step_roots, self.roots_step = [], probe.facts.steps
        retain = bool(args[1] if len(args) > 1 else kwargs.get("retain_graph"))
        for root in (r for r in roots if r.grad_fn is not None):
            # Only a retained graph can be run through again; its site is looked up only then.
            earlier = next((e for e in self.step_roots if e[0] is root.grad_fn), None)
            if earlier is not None:
                call_sites = [earlier[1], site_text(user_site())]
                probe.record(
                    "repeated-backward",
                    RepeatedBackward(step=probe.next_step, call_sites=call_sites, retain_graph=earlier[2]),
                )
            elif retain and len(self.step_roots) < 64:
                self.step_roots.append((root.grad_fn, site_text(user_site()), retain))
            if not retain:
                self.recent_roots.append((root.grad_fn, probe.next_step))

    def _backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        probe, facts = self.probe, self.probe.facts
        original = _ORIGINAL_BACKWARD
        if probe.state.busy:
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
            probe.safely(self._before_backward, loss_finite)
            probe.safely(self._repeated, roots, args, kwargs)
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
                probe.safely(self._inplace_error, roots, exc)
            elif not light and "backward through the graph a second time" in text:
                probe.safely(self._graph_reused, exc)
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
        facts.closure_backward_calls += probe.state.in_step
        if facts.backward_calls == 4 * probe.anomaly_steps and not light:
            torch.autograd.set_detect_anomaly(False)  # a script that rarely steps: stop recording stacks
        probe.emit("backward_counted")
        if not light:
            probe.safely(probe.emit, "backward_done", roots)
        if not light and loss_finite and not facts.events.get("nonfinite-grad"):
            probe.safely(self._check_grads, hooks)
        return result

    def _before_backward(self, loss_finite: bool) -> None:
        probe = self.probe
        if not loss_finite:
            probe.emit("loss_nonfinite")
            probe.record(
                "nonfinite-loss",
                NonfiniteLoss(step=probe.next_step, op=probe.state.step_nonfinite_op, site=user_site()),
            )
            probe.state.watch_ops = False

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
        culprit = {**(culprit or {}), **self._modified_tensor(message)}
        self.probe.record("inplace-modified", InplaceModified(step=self.probe.next_step, error=message, **culprit))

    def _modified_tensor(self, message: str) -> dict[str, Any]:
        """The tensor autograd names by shape and version (``[torch.FloatTensor [32, 1]] ... is at
        version 2``), as a parameter name when a parameter (or its transpose) matches: then an
        optimizer's step() changed it in place after the forward pass saved it."""
        match = _MODIFIED.search(message)
        if match is None:
            return {}
        shape = [int(x) for x in match.group(1).replace(" ", "").split(",") if x]
        version = int(match.group(2))
        probe = self.probe
        names = probe.param_names()
        for p in probe.all_params():
            if list(p.shape) in (shape, shape[::-1]) and p._version == version and id(p) in names:
                return {"tensor": names[id(p)], "by_optimizer_step": True}
        return {"tensor": f"a tensor of shape {shape}", "by_optimizer_step": False}

    def _graph_reused(self, exc: RuntimeError) -> None:
        """backward() reached a graph an earlier backward already freed: find the tensor from an
        earlier step that this step's graph still hangs on (a hidden state carried across steps)."""
        probe = self.probe
        found, _ = census(probe.next_step, probe.state.tracked, probe.state.last_census, want_holder=True)
        probe.record(
            "graph-reused",
            GraphReused(
                step=probe.next_step, holder=found["holder"], error=str(exc).split("\n")[0][:300], **(user_site() or {})
            ),
        )

    def _module_at(self, site: dict[str, Any]) -> str | None:
        """The module whose ``forward`` holds ``file:line``."""
        probe = self.probe
        for root, _ in probe.state.roots.values():
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
