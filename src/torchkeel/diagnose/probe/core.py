"""The probe: installs the listeners, holds what they share, and dispatches their events.

Each concern is a listener of its own (``modules``, ``backward``, ``optim``, ``data``, ``seeds``,
``habits``, ``loop``, ``scale``, ``losses``) that owns its state and writes its part of ``Facts``
when the script ends. What they share is ``state`` (a ``ProbeState``: where the script is, the
models and their names, the tensors with a graph for censuses), ``record`` (typed events,
``diagnose.events``), ``safely`` (an observation never breaks the script) and ``emit``: an
event (``state.EVENTS``) goes to every listener with an ``on_<event>`` method.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from torchkeel.diagnose.events import ProbeError
from torchkeel.diagnose.invariants import LISTENERS as INVARIANT_LISTENERS
from torchkeel.diagnose.probe.backward import BackwardListener
from torchkeel.diagnose.probe.data import LoaderListener
from torchkeel.diagnose.probe.facts import Facts, StopScript
from torchkeel.diagnose.probe.habits import HabitListener
from torchkeel.diagnose.probe.loop import LoopListener
from torchkeel.diagnose.probe.losses import LossListener
from torchkeel.diagnose.probe.modules import ModuleListener
from torchkeel.diagnose.probe.optim import OptimizerListener
from torchkeel.diagnose.probe.scale import ScaleListener
from torchkeel.diagnose.probe.seeds import SeedListener
from torchkeel.diagnose.probe.state import EVENTS, ProbeState
from torchkeel.introspect.sites import has_graph, tensors_in


class Probe:
    """Install with ``with Probe(...) as probe:``; read ``probe.facts`` afterwards.

    Args:
        max_steps: raise ``StopScript`` after this many optimizer steps (None: never).
        anomaly_steps: steps run with autograd anomaly mode recording forward stacks.
        light: only losses and steps (the second run of a reproducibility check).
        compiling: leave out what torch.compile cannot trace through (``keel diagnose --compile``);
            a script that calls torch.compile gets the same from that call on.
    """

    def __init__(
        self, *, max_steps: int | None = None, anomaly_steps: int = 2, light: bool = False, compiling: bool = False
    ) -> None:
        self.max_steps, self.anomaly_steps, self.light, self.compiling = max_steps, anomaly_steps, light, compiling
        self.facts = Facts()
        self.state = ProbeState()
        self.started_at = 0.0
        self._undo: list[Callable[[], None]] = []
        self.modules, self.backward, self.optim = ModuleListener(self), BackwardListener(self), OptimizerListener(self)
        self.data, self.seeds, self.habits = LoaderListener(self), SeedListener(self), HabitListener(self)
        self.loop, self.scale, self.losses = LoopListener(self), ScaleListener(self), LossListener(self)
        listeners = (self.modules, self.backward, self.optim, self.data, self.seeds, self.habits)
        self.modules.loss_checks.update(self.losses.checks())
        for dropout in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout):
            self.modules.loss_checks[dropout] = self.habits.check_dropout
        self.modules.loss_checks.update(self.scale.softmaxes())
        # Built last: an invariant listener may add its checks to those above (chaining any it shares).
        self.invariants = tuple(listener(self) for listener in INVARIANT_LISTENERS)
        listeners += (self.loop, self.scale, self.losses, *self.invariants)
        self._handlers: dict[str, list[Callable[..., None]]] = {
            event: [getattr(x, f"on_{event}") for x in listeners if hasattr(x, f"on_{event}")] for event in EVENTS
        }

    # ---------------------------------------------------------------- install / uninstall
    def __enter__(self) -> Probe:
        self.started_at = time.perf_counter()
        self.backward.install()
        self.optim.install()
        self.seeds.install()
        if not self.light:
            self.patch(torch, "compile", self._stepping_aside(torch.compile))
            self.optim.install_zero_grad()
            self.data.install()
            self.habits.install()
            self.loop.install()
            self.seeds.note_start()
            for listener in self.invariants:
                if hasattr(listener, "install"):
                    listener.install()
            if self.anomaly_steps > 0:
                previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
                torch.autograd.set_detect_anomaly(True, check_nan=False)
                self._undo.append(lambda: torch.autograd.set_detect_anomaly(*previous))
                warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
            if not self.compiling:
                self.modules.install()
        return self

    def step_aside(self) -> None:
        """Remove what torch.compile cannot trace through (module hooks, the function mode): from
        here on, module-level facts (names, non-finite outputs, loss arguments) are not collected."""
        self.modules.uninstall()
        self.compiling = True

    def _stepping_aside(self, original: Callable) -> Callable:
        probe = self

        def compile(*args: Any, **kwargs: Any) -> Any:
            probe.step_aside()
            return original(*args, **kwargs)

        return compile

    def __exit__(self, *exc: Any) -> None:
        self.facts.wall_s = time.perf_counter() - self.started_at
        self.step_aside()
        if not self.light:
            if self.state.step_nonfinite_op is not None and not self.facts.events.get("nonfinite-loss"):
                # The step went non-finite outside modules and the script ended before a backward
                # (it crashed on the NaN): what was found is kept as the loss computation's op.
                op = self.state.step_nonfinite_op
                self.record("nonfinite-loss", {"step": op["step"], "op": op, "site": None, "before_backward": True})
            self.seeds.finish()
            self.facts.events["graph-reused"] = self.facts.events.get("graph-reused", [])
            self.modules.finish()
            self.optim.finish()
            self.habits.finish()
            self.loop.finish()
            self.scale.finish()
            self.data.finish()
            for listener in self.invariants:
                if hasattr(listener, "finish"):
                    self.safely(listener.finish)
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:  # noqa: BLE001 - undo the rest even if the mode stack was left unbalanced
                pass

    def patch(self, owner: Any, name: str, replacement: Any) -> None:
        """Replace ``owner.name`` until the probe is uninstalled."""
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, replacement)
        self._undo.append(lambda: setattr(owner, name, original))

    def emit(self, event: str, *args: Any) -> None:
        """Tell every listener that handles ``event`` (one of ``state.EVENTS``), in install order.
        Not run ``safely``: a caller inside an observation is already."""
        for handler in self._handlers[event]:
            handler(*args)

    def on_exit(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def safely(self, fn: Callable, *args: Any) -> None:
        """Run an observation; a bug in it must never break the script."""
        self.state.busy = True
        try:
            fn(*args)
        except StopScript:
            raise
        except Exception as exc:  # noqa: BLE001
            self.record("probe-error", ProbeError(error=f"{type(exc).__name__}: {exc}"[:300]))
        finally:
            self.state.busy = False

    def record(self, kind: str, event: Any, limit: int = 5) -> None:
        """Keep ``event`` (of ``diagnose.events.KINDS[kind]``) if fewer than ``limit`` of its kind are kept."""
        found = self.facts.events.setdefault(kind, [])
        if len(found) < limit:
            found.append(event)

    @property
    def next_step(self) -> int:
        """The step the script is in (1-based: the optimizer steps done, plus one)."""
        return self.facts.steps + 1

    # ---------------------------------------------------------------- names
    def name_of(self, module: torch.nn.Module) -> str:
        for root, label in self.state.roots.values():
            if root is module:
                return label
        for root, label in self.state.roots.values():
            for name, sub in root.named_modules():
                if sub is module and name:
                    return f"{label}.{name}"
        return type(module).__name__

    def param_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for root, label in self.state.roots.values():
            for name, p in root.named_parameters():
                names.setdefault(id(p), f"{label}.{name}")
        return names

    def owner_of(self) -> dict[int, torch.nn.Module]:
        """Parameter id → the module that holds it directly."""
        owners: dict[int, torch.nn.Module] = {}
        for root, _ in self.state.roots.values():
            for sub in root.modules():
                for p in sub.parameters(recurse=False):
                    owners.setdefault(id(p), sub)
        return owners

    def all_params(self) -> list[torch.nn.Parameter]:
        """The optimizers' parameters, else the models'."""
        return [p for opt in self.state.optimizers for g in opt.param_groups for p in g["params"]] or [
            p for root, _ in self.state.roots.values() for p in root.parameters()
        ]

    def track(self, obj: Any) -> None:
        for t in tensors_in(obj):
            if has_graph(t):
                self.state.tracked.append(weakref.ref(t))
        if len(self.state.tracked) > 50000:  # a loop without optimizer steps: keep the live ones only
            self.state.tracked = [r for r in self.state.tracked if r() is not None]
