"""Invariants: depth (see ``diagnose.invariants``).

Each layer starts at a scale that keeps the signal's size through the stack: Glorot & Bengio (2010)
and He et al. (2015) set a weight's standard deviation near ``1/sqrt(fan_in)`` to ``sqrt(2/fan_in)``
(PyTorch's default gives ``std·sqrt(fan_in)`` ≈ 0.58, He's ≈ 1.41). Weights drawn at ``std=1`` on a
layer of 100 inputs are 10× that: activations saturate or explode from the first step. At the first
step, before the optimizer moves anything, ``std·sqrt(fan_in)`` is measured for each trained Linear,
Conv and recurrent weight; most of them ≥ 4 (or, non-zero, under 0.05) is an initialisation off scale.

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
from torchkeel.diagnose.invariants.common import chained
from torchkeel.diagnose.invariants.updates import is_sampled
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "depth"
_MIN_STEPS = 3  # sampled steps at which the same pair was seen
_LINEAR_OPS = {"Addmm", "Mm"}
_SCALED = (torch.nn.Linear, torch.nn.modules.conv._ConvNd, torch.nn.RNNBase, torch.nn.RNNCellBase)
_TOO_LARGE = 4.0  # std·sqrt(fan_in): about 3× He's 1.41, 7× PyTorch's default 0.58
_TOO_SMALL = 0.05  # ... and under a tenth of the default (zero-initialised weights are not counted)
_PASS_THROUGH = (*_VIEWS, "NativeDropout")
_SCALINGS = {"Mul", "Div"}


class Listener:
    """The linear calls at sampled training steps, and which one fed the next directly; the weights'
    scale at the first step."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.scales: list[dict[str, Any]] | None = None
        self.last: dict[str, Any] | None = None  # the latest linear call: name, input and output features
        self.pairs: dict[tuple[str, str], dict[str, Any]] = {}

    def install(self) -> None:
        checks = self.probe.modules.loss_checks
        checks[F.linear] = chained(checks.get(F.linear), self.check)

    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        self.last = None

    def on_step_begins(self) -> None:
        if self.scales is not None or self.probe.light:
            return
        held = {id(p) for opt in self.probe.state.optimizers for g in opt.param_groups for p in g["params"]}
        names = self.probe.param_names()
        self.scales = []
        for root, _ in self.probe.state.roots.values():
            for m in root.modules():
                if not isinstance(m, _SCALED):
                    continue
                for name, w in m.named_parameters(recurse=False):
                    if name.startswith("weight") and w.dim() >= 2 and id(w) in held and w.numel() >= 16:
                        fan_in = w[0].numel()
                        scale = float(w.detach().float().std()) * fan_in**0.5
                        self.scales.append({"parameter": names.get(id(w), name), "scale": round(scale, 4)})

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
        self.probe.facts.invariants[FAMILY] = {"stacked": stacked[:8], "scales": (self.scales or [])[:64]}


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


def init_scale(facts: Any, outcome: object) -> list[Finding]:
    scales = [s for s in (facts.invariants.get(FAMILY) or {}).get("scales", []) if s["scale"] > 0]
    for off, word in (
        ((s for s in scales if s["scale"] >= _TOO_LARGE), "large"),
        (
            (s for s in scales if s["scale"] < _TOO_SMALL),
            "small",
        ),
    ):
        off = list(off)
        if not scales or 2 * len(off) < len(scales):
            continue
        first = max(off, key=lambda s: s["scale"]) if word == "large" else min(off, key=lambda s: s["scale"])
        message = (
            f"{len(off)} of {len(scales)} trained weight tensors start too {word}: std·sqrt(fan_in) is "
            f"{first['scale']:.3g} for {first['parameter']} (PyTorch's default init gives 0.58, He's 1.41): "
            + (
                "activations saturate or explode from the first step"
                if word == "large"
                else "the signal fades layer by layer"
            )
        )
        evidence = {"parameters": off[:16], "num_off": len(off), "num_weights": len(scales)}
        evidence["threshold"] = _TOO_LARGE if word == "large" else _TOO_SMALL
        fix = "keep PyTorch's default init, or draw weights with std ≈ sqrt(2 / fan_in) (nn.init.kaiming_normal_)"
        return [Finding("invariant-init-scale", "warning", message, evidence, fix)]
    return []


IDS: tuple[str, ...] = ("invariant-init-scale", "invariant-linear-stack")
DETECTORS: tuple = (init_scale, linear_stack)
EXPLAINED_BY: dict[str, set[str]] = {"invariant-init-scale": {"params-not-updating", "frozen-parameters"}}
