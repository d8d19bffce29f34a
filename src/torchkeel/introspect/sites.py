"""Where in the user's code something happened: the innermost frame outside torch, numpy,
the standard library and torchkeel, and names for modules as the user's script spells them."""

from __future__ import annotations

import os
import sys
import sysconfig
import types
from typing import Any

import numpy
import torch

_LIBRARY_ROOTS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (
        torch.__file__,
        numpy.__file__,
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "__init__.py"),
    )
) + tuple(
    os.path.abspath(p) + os.sep
    for p in dict.fromkeys((sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]))
)


def is_user_file(filename: str) -> bool:
    """True for files the user wrote (the script and its local modules), not libraries."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return not path.startswith(_LIBRARY_ROOTS) and "site-packages" not in path


def user_frame(start: types.FrameType | None = None) -> types.FrameType | None:
    """The innermost frame (from ``start``, default the caller) that lies in user code."""
    frame = start or sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def user_site(start: types.FrameType | None = None) -> dict[str, Any] | None:
    """``{"file", "line", "function"}`` of the innermost user frame, or None (library only)."""
    frame = user_frame(start or sys._getframe(1))
    if frame is None:
        return None
    return {"file": display_path(frame.f_code.co_filename), "line": frame.f_lineno, "function": frame.f_code.co_name}


def display_path(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it, else absolute."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def site_text(site: dict[str, Any] | None) -> str:
    return f"{site['file']}:{site['line']}" if site else "<library code>"


def variable_name(obj: Any, frame: types.FrameType | None) -> str | None:
    """The name a user frame (or its globals, or an enclosing frame) binds to ``obj``."""
    while frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            for name, value in list(scope.items()):
                if value is obj and not name.startswith("__"):
                    return name
            for name, value in list(scope.items()):
                if isinstance(value, (tuple, list)) and not name.startswith("__") and len(value) <= 16:
                    index = next((i for i, item in enumerate(value) if item is obj), None)
                    if index is not None:
                        return f"{name}[{index}]"  # an LSTM's (h, c) state
            for name, value in list(scope.items()):
                attrs = getattr(value, "__dict__", None)
                if (
                    isinstance(attrs, dict)
                    and not isinstance(value, (type, types.ModuleType, torch.nn.Module))
                    and not name.startswith("__")
                ):
                    attr = next((a for a, v in list(attrs.items()) if v is obj), None)
                    if attr is not None:
                        return f"{name}.{attr}"  # self.model in a Trainer class
            for name, value in list(scope.items()):
                if isinstance(value, torch.nn.Module) and value is not obj and not name.startswith("__"):
                    for attr, child in value.named_children():
                        if child is obj:
                            return f"{name}.{attr}"
        frame = frame.f_back
        while frame is not None and not is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
    return None


def has_graph(t: torch.Tensor) -> bool:
    """``t.grad_fn is not None``, and False where autograd refuses to answer (a view made under
    no_grad whose base was then changed in place raises on ``.grad_fn``): looking must not raise."""
    try:
        return t.grad_fn is not None
    except RuntimeError:
        return False


def tensors_in(obj: Any, limit: int = 64) -> list[torch.Tensor]:
    """Tensors directly in ``obj`` or one level of list/tuple/dict inside it."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple, dict)):
            found.extend(tensors_in(item, limit))
        if len(found) >= limit:
            break
    return found


def is_nonfinite(t: torch.Tensor) -> bool:
    """True when a floating-point tensor holds NaN or Inf (a host sync)."""
    if t.is_meta:
        return False  # no values (a model built on the meta device before its weights load)
    return (t.is_floating_point() or t.is_complex()) and t.numel() > 0 and not bool(torch.isfinite(t).all())


def nonfinite_layout(t: torch.Tensor, limit: int = 20) -> dict[str, Any]:
    """Which rows (samples) and columns (features) of ``t`` hold NaN/Inf, and how many values."""
    bad = ~torch.isfinite(t.detach())
    layout: dict[str, Any] = {
        "shape": list(t.shape),
        "num_nonfinite": int(bad.sum()),
        "has_nan": bool(torch.isnan(t.detach()).any()),
        "has_inf": bool(torch.isinf(t.detach()).any()),
    }
    if t.dim() >= 1:
        rows = bad.reshape(t.shape[0], -1).any(dim=1).nonzero().flatten()
        layout["samples"] = rows[:limit].tolist()
        layout["num_samples"] = int(rows.numel())
    if t.dim() >= 2:
        cols = bad.transpose(0, 1).reshape(t.shape[1], -1).any(dim=1).nonzero().flatten()
        layout["features"] = cols[:limit].tolist()
    return layout
