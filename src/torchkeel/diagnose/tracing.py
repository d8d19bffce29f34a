"""Autograd-graph helpers of the probe: the first op (forward) or backward function that turned
finite values non-finite, walking a graph, and where an anomaly-mode stack points in user code."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from torchkeel.introspect.graph import graph_nodes
from torchkeel.introspect.sites import (
    display_path,
    is_nonfinite,
    is_user_file,
    tensors_in,
    user_site,
)


def nonfinite_scalar(value: Any) -> bool:
    return isinstance(value, float) and not np.isfinite(value)


def allocates_uninitialized(func: Any) -> bool:
    """``torch.empty`` and its kin return whatever the memory held — a NaN there is no op's doing
    (the values are written before they are read: ``nn.Linear`` initializes what ``empty`` gave)."""
    return "empty" in getattr(func, "__name__", "")


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", str(func))
    owner = getattr(func, "__module__", None) or ""
    if owner.startswith("torch.nn.functional"):
        return f"F.{name}"
    if "Tensor" in getattr(func, "__qualname__", ""):
        return f"Tensor.{name}"
    return f"torch.{name}"


class FirstNonfiniteOp(TorchFunctionMode):
    """Records the first op whose floating output is non-finite while its inputs were finite."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, Any] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.found is None and not allocates_uninitialized(func):
            outs = [t for t in tensors_in(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            values = list(args) + list(kwargs.values())
            if (
                outs
                and any(is_nonfinite(t) for t in outs)
                and not any(nonfinite_scalar(a) for a in values)
                and not any(is_nonfinite(t) for t in tensors_in(values))
            ):
                self.found = {"op": op_name(func), **(user_site(sys._getframe(1)) or {})}
        return out


class GradTracer:
    """Hooks on every node of a backward graph; names the first backward op whose output
    gradients turned non-finite while the gradients it received were finite."""

    def __init__(self, roots: list[torch.Tensor]) -> None:
        self.found: dict[str, Any] | None = None
        self.handles = []
        nodes = graph_nodes([r.grad_fn for r in roots if r.grad_fn is not None], limit=2000)
        for node in nodes:
            try:
                self.handles.append(node.register_hook(self._hook(node)))
            except RuntimeError:
                pass

    def _hook(self, node: Any) -> Callable:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            if self.found is None:
                try:
                    look(grad_inputs, grad_outputs)
                except Exception:  # noqa: BLE001 - runs inside the script's backward: never raise there
                    self.found = {}

        def look(grad_inputs: Any, grad_outputs: Any) -> None:
            produced = [g for g in grad_inputs if isinstance(g, torch.Tensor)]
            received = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
            if any(is_nonfinite(g) for g in produced) and not any(is_nonfinite(g) for g in received):
                self.found = {"backward_op": type(node).__name__}
                trace = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
                if trace:
                    self.found.update(forward_site(trace))

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def forward_site(trace: str | list[str]) -> dict[str, Any]:
    """The innermost user frame of an anomaly-mode forward traceback (``File "x", line N, in f``)."""
    import re

    if not isinstance(trace, str):
        trace = "".join(trace)
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
    for path, line, function in reversed(frames):
        if is_user_file(path):
            return {"file": display_path(path), "line": int(line), "function": function}
    return {}
