"""Censuses of live autograd graphs (what keeps a step's graph alive into the next) and names
for what holds a tensor, as the user's code spells them: a variable, a list, an attribute."""

from __future__ import annotations

import collections
import gc
import linecache
import re
import sys
import types
import weakref
from typing import Any

import torch

from torchkeel.introspect.graph import graph_nodes
from torchkeel.introspect.sites import has_graph, site_text, user_frame, user_site


def census(
    step: int,
    tracked: list[weakref.ref],
    previous: list[weakref.ref],
    want_holder: bool,
    roots: dict[int, int] | None = None,
) -> tuple[dict[str, Any], list[weakref.ref]]:
    """Live tensors that hold an autograd graph (among those the probe has seen made: module
    outputs, ops outside modules, losses), the size of the largest graph, and what holds the one
    kept longest. Returns the census and the pruned weak references of the live ones.

    ``roots`` maps the ids of the root nodes of recent backward passes (held alive by the caller,
    so an id is not reused) to their step: a live tensor whose graph reaches those of two steps,
    other than its own, keeps graphs that backward already ran through (``total_loss += loss``),
    and so do the losses of two earlier steps still alive (a list of them), whatever the sizes do
    from one census to the next. A tensor that reaches one step's passes only is replaced each
    step (``errD = errD_real + errD_fake``)."""
    roots = roots or {}
    seen: dict[int, torch.Tensor] = {}
    for ref in tracked:
        t = ref()
        if t is not None and has_graph(t):
            seen[id(t)] = t
    holders = list(seen.values())
    largest, largest_nodes, budget = None, 0, 200000
    spanning, spans = None, 0
    for t in holders:
        found = graph_nodes([t.grad_fn], limit=min(20000, budget))
        nodes = len(found)
        budget -= nodes
        if nodes > largest_nodes:
            largest, largest_nodes = t, nodes
        if roots:
            steps = [roots[id(n)] for n in found if id(n) in roots and n is not t.grad_fn]
            # The passes of one step only (a GAN's errD = errD_real + errD_fake, kept until the
            # next iteration reassigns it) are replaced each step: a leak spans several steps.
            reached = len(steps) if len(set(steps)) >= 2 else 0
            if reached > spans:
                spanning, spans = t, reached
        if budget <= 0:
            break
    # Losses of two or more earlier steps still alive themselves (a list of loss tensors).
    kept = sorted((roots[id(t.grad_fn)], id(t), t) for t in holders if roots.get(id(t.grad_fn), step) < step)
    if len({made for made, _, _ in kept}) >= 2 and len(kept) > spans:
        spanning, spans = kept[0][2], len(kept)
    del kept
    survivors = [t for t in (r() for r in previous) if t is not None and id(t) in seen and t.grad_fn is not None]
    keep = max(survivors, key=lambda t: len(graph_nodes([t.grad_fn], limit=20000))) if survivors else largest
    if spans:
        keep, want_holder = spanning, True
    refs = [weakref.ref(t) for t in holders]
    ignore = {id(holders), id(survivors), id(seen)}
    census = {
        "step": step,
        "num_tensors": len(holders),
        "max_graph_nodes": largest_nodes,
        "backward_graphs_held": spans,
        "holder": holder_of(keep, ignore) if keep is not None and want_holder else None,
    }
    del holders, survivors, largest, seen, spanning, keep
    return census, refs


def holder_of(t: torch.Tensor, ignore: set[int]) -> str | None:
    """What keeps ``t`` alive, as the user would name it: a variable, a list, an attribute."""
    named = _name_in_stack(t)
    if named:
        return f"variable {named}"
    for ref in gc.get_referrers(t):
        if id(ref) in ignore:
            continue
        if isinstance(ref, dict):
            for name, value in ref.items():
                if value is t and isinstance(name, str):
                    return f"{_dict_owner(ref) or 'dict key '}'{name}'"
        elif isinstance(ref, (list, tuple, set, collections.deque)):
            kind = type(ref).__name__
            name = _name_in_stack(ref) or _attribute_name(ref)
            return f"{kind} {name}" if name else f"a {kind}"
        elif not isinstance(ref, torch.Tensor) and hasattr(ref, "__dict__"):
            name = _attribute_name(t)
            if name:
                return name
    return None


def _name_in_stack(obj: Any) -> str | None:
    """``'name' in function() (file:line)`` for the user frame on the current stack that binds ``obj``."""
    frame = sys._getframe(1)
    while frame is not None:
        if user_frame(frame) is frame:
            for name, value in frame.f_locals.items():
                if value is obj:
                    scope = "global" if frame.f_code.co_name == "<module>" else f"in {frame.f_code.co_name}()"
                    site = user_site(frame)
                    line = _accumulating_line(frame, name)
                    return f"'{name}' {scope} ({site_text({**site, 'line': line} if site and line else site)})"
        frame = frame.f_back
    return None


def _accumulating_line(frame: types.FrameType, name: str) -> int | None:
    """The line of ``frame``'s function that adds to ``name`` (``name += x``, ``name.append(x)``),
    else the last that assigns it: where the graphs are kept, not where the census found them."""
    code = frame.f_code
    grows = re.compile(rf"(?<![\w.]){re.escape(name)}\s*(\+=|-=|\.append\(|\.extend\(|\.insert\()")
    assigns = re.compile(rf"(?<![\w.]){re.escape(name)}\s*=[^=]")
    numbers = sorted({line for _, _, line in code.co_lines() if line})
    lines = [(n, linecache.getline(code.co_filename, n)) for n in numbers]
    grown = [n for n, text in lines if grows.search(text)]
    assigned = [n for n, text in lines if assigns.search(text)]
    if grown:
        return grown[0]
    return assigned[-1] if assigned else None


def _attribute_name(obj: Any) -> str | None:
    """``attribute 'x' of Class`` (or ``global 'x'``) for the object or module that holds ``obj``."""
    for ref in gc.get_referrers(obj):
        owners = (
            [ref]
            if not isinstance(ref, dict)
            else [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
        )
        for owner in owners:
            attrs = getattr(owner, "__dict__", None)
            if not isinstance(attrs, dict):
                continue
            for name, value in attrs.items():
                if value is obj:
                    if isinstance(owner, types.ModuleType):
                        return f"global '{name}'"
                    return f"attribute '{name}' of {type(owner).__name__}"
    return None


def _dict_owner(d: dict) -> str | None:
    for ref in gc.get_referrers(d):
        if getattr(ref, "__dict__", None) is d:
            return "global " if isinstance(ref, types.ModuleType) else f"attribute of {type(ref).__name__}: "
    return "global " if d.get("__name__") == "__main__" else None
