"""Autograd graphs: the nodes a tensor's graph holds (a leak census, a diagnosis of a graph kept
across steps)."""

from __future__ import annotations

from typing import Any


def graph_nodes(starts: list[Any], limit: int | None = None) -> list[Any]:
    """The autograd graph nodes reachable from ``starts`` (grad_fns), each once; at most ``limit``."""
    seen: list[Any] = []
    ids: set[int] = set()
    todo = list(starts)
    while todo and (limit is None or len(seen) < limit):
        node = todo.pop()
        if node is None or id(node) in ids:
            continue
        ids.add(id(node))
        seen.append(node)
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return seen
