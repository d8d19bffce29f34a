"""Invariants: depth (see ``diagnose.invariants``).

Each layer a model stacks adds what it can compute: a linear layer fed straight from another
linear layer (through views or dropout only) composes with it into one linear map, so the pair is
no more expressive than a single layer, however wide the layer between (an activation forgotten
between ``fc1`` and ``fc2``). A bottleneck narrower than both ends is left alone: a low-rank
factorisation on purpose (LoRA's ``B(A(x))``, a linear autoencoder).

At sampled training steps, each ``F.linear`` call (``nn.Linear`` makes them) looks at what made
its input: a matrix product (``addmm``/``mm``) means the linear call before it fed it directly.
The check reads grad_fn names and shapes only, nothing per element.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.diagnose.invariants._losses_arguments import VIEWS as _VIEWS
from torchkeel.diagnose.invariants.losses import _chained
from torchkeel.diagnose.invariants.updates import is_sampled
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "depth"
_MIN_STEPS = 3  # sampled steps at which the same pair was seen
_LINEAR_OPS = {"Addmm", "Mm"}
_PASS_THROUGH = (*_VIEWS, "NativeDropout")
_SCALINGS = {"Mul", "Div"}


class Listener:
    """The linear calls at sampled training steps, and which one fed the next directly."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.last: dict[str, Any] | None = None  # the latest linear call: name, input and output features
        self.pairs: dict[tuple[str, str], dict[str, Any]] = {}

    def install(self) -> None:
        checks = self.probe.modules.loss_checks
        checks[F.linear] = _chained(checks.get(F.linear), self.check)

    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        self.last = None

    def check(self, func: Callable, args: Any, kwargs: dict) -> None:
        probe = self.probe
        if probe.light or not torch.is_grad_enabled() or not is_sampled(probe.next_step):
            return
        x = args[0] if args else kwargs.get("input")
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or w.dim() != 2:
            return
        stack = probe.state.module_stack
        name = probe.name_of(stack[-1]) if stack else "F.linear"
        here = {"name": name, "in": int(w.shape[1]), "out": int(w.shape[0])}
        before, self.last = self.last, here
        if before is None or _made_by(x) not in _LINEAR_OPS or before["out"] != here["in"]:
            return
        if before["out"] < min(before["in"], here["out"]):
            return  # a bottleneck: a low-rank factorisation on purpose
        pair = self.pairs.setdefault(
            (before["name"], name), {"first": before, "second": here, "steps": [], **site_fields(user_site() or {})}
        )
        if probe.next_step not in pair["steps"] and len(pair["steps"]) < 8:
            pair["steps"].append(probe.next_step)

    def finish(self) -> None:
        stacked = [p for p in self.pairs.values() if len(p["steps"]) >= _MIN_STEPS]
        self.probe.facts.invariants[FAMILY] = {"stacked": stacked[:8]}


def _made_by(x: torch.Tensor) -> str | None:
    node = x.grad_fn
    for _ in range(8):
        if node is None:
            return None
        name = re.sub(r"Backward\d*$", "", type(node).__name__)
        inputs = [f for f, _ in node.next_functions if f is not None]
        if name in _SCALINGS and len(inputs) == 1:
            node = inputs[0]  # times a constant or a mask (dropout on the CPU): still linear
            continue
        if not name.startswith(_PASS_THROUGH) or not node.next_functions:
            return name
        node = node.next_functions[0][0]
    return None


def linear_stack(facts: Any, outcome: object) -> list[Finding]:
    stacked = (facts.invariants.get(FAMILY) or {}).get("stacked", [])
    if not stacked:
        return []
    p = stacked[0]
    a, b = p["first"], p["second"]
    message = (
        f"{a['name']} ({a['in']}→{a['out']}) feeds {b['name']} ({b['in']}→{b['out']}) with no nonlinearity "
        f"between (sampled steps {p['steps'][:4]}): two linear layers compose into one linear map "
        f"({a['in']}→{b['out']}), and the layer between adds parameters but nothing it can learn"
    )
    evidence = {"first": a["name"], "second": b["name"], "pairs": stacked, "steps": p["steps"]}
    evidence.update(site_fields(p))
    fix = f"put an activation (ReLU, GELU, tanh) between {a['name']} and {b['name']}"
    return [Finding("invariant-linear-stack", "warning", message, evidence, fix)]


IDS: tuple[str, ...] = ("invariant-linear-stack",)
DETECTORS: tuple = (linear_stack,)
EXPLAINED_BY: dict[str, set[str]] = {}
