"""Invariants: units — the units of a layer differ from each other, and its activations are not
almost all zero (see ``diagnose.invariants``).

- **Symmetry.** Units that start identical get identical gradients and stay identical: a layer of
  copies computes one feature however wide it is. Random initialisation breaks the symmetry, and a
  zero-initialised layer (a LoRA factor, a head) breaks it within its first steps. At the end of
  the run, the rows of each trained Linear/Conv weight (one row a unit) are compared: rows that
  equal another row (within ``SAME`` of the largest row's norm) are copies. The line that filled
  the weight with a constant before the first step (``nn.init.constant_``, ``zeros_``,
  ``fill_``) is named when there was one.
- **Death.** A ReLU unit whose input is negative for every sample gives no output and no gradient;
  a healthy network keeps most units alive (about half of a ReLU's outputs are zero per sample,
  far fewer for every sample of a batch). At sampled steps (``is_sampled``), each ReLU inside a
  model (``nn.ReLU``, ``F.relu``, ``torch.relu``, ``ReLU6``, a leaky ReLU with a slope under
  ``LEAKY_DEAD``) on a batch of ≥ ``MIN_BATCH`` samples records the fraction of its units that are
  ≤ 0 for the whole batch; the fraction stays on the device until the end (no host sync).

Both read the function mode's calls (``probe.modules.loss_checks``), which step aside with it when
the script compiles.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.diagnose.invariants.common import chained
from torchkeel.diagnose.invariants.updates import is_sampled
from torchkeel.introspect.sites import is_nonfinite, site_text, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe
    from torchkeel.diagnose.probe.facts import Facts

FAMILY = "units"
IDS: tuple[str, ...] = ("invariant-units-identical", "invariant-units-dead")

SAME = 1e-5  # rows closer than this x the largest row's norm are copies
COPIES = 0.25  # a layer is flagged when at least this fraction of its units are copies
MIN_STEPS = 3  # ... after this many steps (a zero-initialised layer differentiates in its first ones)
DEAD = 0.9  # a ReLU is dead when at least this fraction of its units are ≤ 0 for the whole batch
DEAD_SAMPLES = 3  # ... at this many sampled steps, the last ones measured among them
MIN_BATCH = 8  # batches smaller than this are not measured (one sample is sparse by chance)
LEAKY_DEAD = 1e-3  # a leaky ReLU with a negative slope under this can die like a ReLU
_KEPT = 24  # samples kept per ReLU (the latest)

_RELUS = (F.relu, torch.relu, torch.Tensor.relu, F.relu_, torch.relu_, torch.Tensor.relu_, F.relu6)
_FILLS = (torch.nn.init.constant_, torch.Tensor.fill_, torch.Tensor.zero_)


class Listener:
    """ReLU calls at sampled steps and constant fills before the first step (the function mode);
    the layers' rows at the end."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.relus: dict[tuple, dict[str, Any]] = {}  # (module id, unit shape) → its samples
        self.fills: dict[int, dict[str, Any]] = {}  # data_ptr → the constant fill before step 1
        self.at_start: dict[int, dict[str, Any]] | None = None  # weight id → its copies at the first step
        checks = probe.modules.loss_checks
        for func in _RELUS:
            checks[func] = chained(checks.get(func), self.check_relu)
        checks[F.leaky_relu] = chained(checks.get(F.leaky_relu), self.check_leaky)
        checks[F.hardtanh] = chained(checks.get(F.hardtanh), self.check_hardtanh)
        for func in _FILLS:
            checks[func] = chained(checks.get(func), self.check_fill)

    # ---------------------------------------------------------------- death
    def check_relu(self, func: Callable, args: Any, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        self._activation(getattr(func, "__name__", "relu"), x)

    def check_leaky(self, func: Callable, args: Any, kwargs: dict) -> None:
        slope = args[1] if len(args) > 1 else kwargs.get("negative_slope", 0.01)
        if isinstance(slope, (int, float)) and slope < LEAKY_DEAD:
            self._activation("leaky_relu", args[0] if args else kwargs.get("input"))

    def check_hardtanh(self, func: Callable, args: Any, kwargs: dict) -> None:
        low = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
        if low == 0:  # ReLU6
            self._activation("relu6", args[0] if args else kwargs.get("input"))

    def _activation(self, name: str, x: Any) -> None:
        probe = self.probe
        step = probe.next_step
        stack = probe.state.module_stack
        if not (is_sampled(step) and torch.is_grad_enabled() and stack and isinstance(x, torch.Tensor)):
            return
        if x.dim() < 2 or x.shape[0] < MIN_BATCH or x.numel() // x.shape[0] < 4 or not x.is_floating_point():
            return
        if next(stack[0].parameters(), None) is None:
            return  # a loss module (a hinge's relu(margin - d) is zero once satisfied), not a model
        module, site = stack[-1], user_site() or {}
        key = (id(module), site.get("file"), site.get("line"), tuple(x.shape[1:]))  # a ReLU reused: one per call
        record = self.relus.get(key)
        if record is None:
            record = self.relus[key] = {
                "module": module,
                "activation": name,
                "shape": list(x.shape[1:]),
                "site": site,
                "samples": collections.deque(maxlen=_KEPT),
                "num_samples": 0,
            }
        if record["samples"] and record["samples"][-1][0] == step:
            return  # once a step (a module called on several batches in one step)
        dead = (x.detach() <= 0).all(dim=0)  # a unit dead for the whole batch
        record["samples"].append((step, dead.float().mean()))
        record["num_samples"] += 1

    # ---------------------------------------------------------------- symmetry
    def check_fill(self, func: Callable, args: Any, kwargs: dict) -> None:
        t = args[0] if args else kwargs.get("tensor")
        if self.probe.facts.steps > 0 or not isinstance(t, torch.Tensor) or t.dim() < 2 or t.is_meta:
            return
        self.fills[t.data_ptr()] = {"call": getattr(func, "__name__", "fill_"), **(user_site() or {})}

    def on_step_begins(self) -> None:
        if self.at_start is None:
            self.at_start = {}
            self.probe.safely(self._note_start)

    def _note_start(self) -> None:
        """The copies among each layer's units before the first update (its initialisation)."""
        for module in list(self.probe.state.leaf_order.values()):
            for _, weight in _unit_weights(module):
                if weight.requires_grad and weight.grad is not None:
                    layer = _copies(weight)
                    if layer is not None:
                        self.at_start[id(weight)] = {k: layer[k] for k in ("num_copies", "row_norm")}

    def finish(self) -> None:
        probe = self.probe
        probe.facts.invariants[FAMILY] = {
            "dead": [self._dead_record(record) for record in self.relus.values() if record["samples"]],
            "identical": self._identical_records(),
            "steps": probe.facts.steps,
        }

    def _dead_record(self, record: dict[str, Any]) -> dict[str, Any]:
        return {
            "module": self.probe.name_of(record["module"]),
            "module_class": type(record["module"]).__name__,
            "activation": record["activation"],
            "unit_shape": record["shape"],
            "steps": [s for s, _ in record["samples"]],
            "dead_fractions": torch.stack([f.to("cpu") for _, f in record["samples"]]).tolist(),
            "num_samples": record["num_samples"],
            **(record["site"] or {}),
        }

    def _identical_records(self) -> list[dict[str, Any]]:
        """Each trained layer's copies at the end, with those at the first step."""
        probe, found = self.probe, []
        for module in list(probe.state.leaf_order.values()):
            for param, weight in _unit_weights(module):
                layer = _copies(weight) if id(weight) in probe.state.trained else None
                if layer is not None:
                    found.append(
                        {
                            "module": probe.name_of(module),
                            "module_class": type(module).__name__,
                            "param": param,
                            **layer,
                            "at_start": (self.at_start or {}).get(id(weight)),
                            "filled_by": self.fills.get(weight.data_ptr()),
                        }
                    )
        return found


def _unit_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The weights whose rows are the module's units: a Linear's or a Conv's (not transposed, not
    pruned), a recurrent layer's input and hidden weights (a row per gate and unit)."""
    if isinstance(module, torch.nn.Linear) or (
        isinstance(module, torch.nn.modules.conv._ConvNd) and not module.transposed
    ):
        weight = getattr(module, "weight", None)
        return [("weight", weight)] if isinstance(weight, torch.Tensor) and not hasattr(module, "weight_orig") else []
    if isinstance(module, torch.nn.RNNBase):
        return [(n, p) for n, p in module.named_parameters(recurse=False) if n.startswith(("weight_ih", "weight_hh"))]
    return []


def _copies(weight: torch.Tensor) -> dict[str, Any] | None:
    """How many rows (units) of ``weight`` equal another row; None when it is not judged (fewer
    than two rows, non-finite values)."""
    if weight.dim() < 2 or weight.shape[0] < 2 or is_nonfinite(weight):
        return None
    rows = weight.detach().reshape(weight.shape[0], -1).float()
    scale = float(rows.norm(dim=1).max())
    # Rows sorted by a fixed projection: copies are neighbours there. The generator is the
    # probe's own (the script's random state is not touched).
    direction = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(0)).to(rows.device)
    order = torch.argsort(rows @ direction)
    ordered = rows[order]
    close = (ordered[1:] - ordered[:-1]).norm(dim=1) <= SAME * max(scale, 1e-30)
    is_copy = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    is_copy[1:] |= close
    is_copy[:-1] |= close
    num_copies = int(is_copy.sum())
    groups = int(close.logical_not().sum()) + 1  # distinct rows among neighbours
    return {
        "num_units": rows.shape[0],
        "num_copies": num_copies,
        "num_distinct": groups,
        "row_norm": scale,
    }


# ---------------------------------------------------------------- detectors (pure: Facts → findings)
def symmetric_layers(facts: Facts) -> list[dict[str, Any]]:
    """The layers with ≥ COPIES of their units (and ≥ 2) copies of one another after ≥ MIN_STEPS
    steps, or copies of one non-zero row at the first step (a constant initialisation: a
    zero-initialised layer starts as copies of the zero row and parts at once)."""
    data = facts.invariants.get(FAMILY, {})

    def many(layer: dict[str, Any], copies: int) -> bool:
        return copies >= max(2, COPIES * layer["num_units"])

    return [
        layer
        for layer in data.get("identical", [])
        if (data.get("steps", 0) >= MIN_STEPS and many(layer, layer["num_copies"]))
        or (many(layer, (layer.get("at_start") or {}).get("num_copies", 0)) and layer["at_start"]["row_norm"] > 0)
    ]


def units_identical(facts: Facts, outcome: object) -> list[Finding]:
    """A trained layer whose units are copies of one another (``symmetric_layers``)."""
    layers = symmetric_layers(facts)
    if not layers:
        return []
    steps = facts.invariants[FAMILY].get("steps")
    first = layers[0]
    at_start = (first.get("at_start") or {}).get("num_copies", 0)
    fill = first.get("filled_by") or {}
    filled = f", filled by {fill['call']} at {site_text(fill)}" if fill.get("file") else ""
    start = f"{at_start} of its units were copies of one another at the first step{filled}; " if at_start else ""
    message = (
        f"{first['module']} ({first['module_class']}{_param(first)}, {first['num_units']} units): {start}"
        f"{first['num_copies']} are copies after {steps} steps ({first['num_distinct']} distinct); units that start "
        f"equal get equal gradients and learn one feature until the layers after them tell them apart"
        + (f"; {len(layers) - 1} more layer(s) alike" if len(layers) > 1 else "")
    )
    evidence = {
        "module": first["module"],
        "module_class": first["module_class"],
        "param": first.get("param", "weight"),
        "num_units": first["num_units"],
        "num_copies": first["num_copies"],
        "num_copies_at_start": at_start,
        "num_distinct": first["num_distinct"],
        "layers": [
            {k: layer[k] for k in ("module", "param", "num_units", "num_copies", "num_distinct")}
            for layer in layers[:10]
        ],
        "step": steps,
        "threshold": COPIES,
        "filled_by": fill.get("call"),
        **site_fields(fill),
    }
    return [
        Finding(
            "invariant-units-identical",
            "warning",
            message,
            evidence,
            "Initialise weights randomly (the layer's default, or nn.init.kaiming_uniform_/xavier_uniform_); keep "
            "constant or zero initialisation for biases and for layers whose input already differs per unit.",
        )
    ]


def units_dead(facts: Facts, outcome: object) -> list[Finding]:
    """A ReLU with ≥ DEAD of its units ≤ 0 for the whole batch at its last DEAD_SAMPLES sampled
    steps and at half of those it was measured at, or more."""
    dead = []
    for relu in facts.invariants.get(FAMILY, {}).get("dead", []):
        fractions = relu["dead_fractions"]
        hits = [f >= DEAD for f in fractions]
        if len(fractions) >= DEAD_SAMPLES and all(hits[-DEAD_SAMPLES:]) and 2 * sum(hits) >= len(hits):
            dead.append(relu)
    if not dead:
        return []
    dead.sort(key=lambda r: -statistics.median(r["dead_fractions"]))
    first = dead[0]
    since = next(s for s, f in zip(first["steps"], first["dead_fractions"]) if f >= DEAD)
    fraction = statistics.median(first["dead_fractions"][-DEAD_SAMPLES:])
    name = first["module"] + (f" ({first['activation']} at {site_text(first)})" if first.get("file") else "")
    message = (
        f"dead activations: {fraction:.0%} of the units after {name} are zero for every sample of the batch, at "
        f"each sampled step from step {since} to {first['steps'][-1]}; they pass no gradient and never recover"
        + (f"; {len(dead) - 1} more activation(s) alike" if len(dead) > 1 else "")
    )
    evidence = {
        "module": first["module"],
        "module_class": first["module_class"],
        "activation": first["activation"],
        "dead_fraction": fraction,
        "since_step": since,
        "step": first["steps"][-1],
        "steps_sampled": len(first["steps"]),
        "unit_shape": first["unit_shape"],
        "activations": [
            {"module": r["module"], "dead_fraction": statistics.median(r["dead_fractions"][-DEAD_SAMPLES:])}
            for r in dead[:10]
        ],
        "threshold": DEAD,
        **site_fields(first),
    }
    return [
        Finding(
            "invariant-units-dead",
            "warning",
            message,
            evidence,
            "Look at what feeds this ReLU: a large negative bias or input shift, or a learning rate that pushed "
            "it negative; lower the learning rate, normalise the input, or use LeakyReLU/GELU.",
        )
    ]


def _param(layer: dict[str, Any]) -> str:
    return f" {layer['param']}" if layer.get("param", "weight") != "weight" else ""


DETECTORS = (units_identical, units_dead)
EXPLAINED_BY: dict[str, set[str]] = {
    "invariant-units-identical": set(),
    "invariant-units-dead": {
        "lr-divergence",
        "grad-exploding",
        "input-scale",
        "nonfinite-input",
        "nonfinite-forward",
        "nonfinite-grad",
    },
}
