"""TK119: a scheduler stepped before its optimizer."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from torchkeel.lint.engine import Source
from torchkeel.lint.rules.loop import Event, training_loops


def scheduler_before_optimizer(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for _, events in training_loops(source):
        # scheduler.step(count) places the schedule itself (and plateau schedulers read a metric):
        # it skips nothing whatever it follows.
        own = [e for e in events if e.depth == 0 and e.kind in ("step", "sched") and not _positioned(e)]
        first_step = next((e for e in own if e.kind == "step"), None)
        first_sched = next((e for e in own if e.kind == "sched"), None)
        if first_step and first_sched and first_sched.order < first_step.order:
            yield (
                first_sched.node,
                (
                    f"{first_sched.target}.step() runs before {first_step.target}.step() in the "
                    "same iteration: the first learning rate of the schedule is skipped"
                ),
            )


def _positioned(event: Event) -> bool:
    return event.kind == "sched" and isinstance(event.node, ast.Call) and bool(event.node.args or event.node.keywords)
