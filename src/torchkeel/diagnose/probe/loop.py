"""The order of the loop's calls and the model's mode: ``zero_grad()`` between a backward and its
step, gradients clipped before the backward that makes them, a learning-rate scheduler stepped
before its optimizer or once a batch on a horizon counted in epochs, micro-batches summed without
dividing the loss, and a model left in eval mode for training after a validation pass.

Fed by the other listeners (a backward done, a zero_grad, a batch fetched, a model called with
gradients on, a step about to run); wraps the clip functions, ``LRScheduler.step`` and
``Module.train`` (``eval()`` calls it) itself.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchkeel.diagnose.events import ClipBeforeBackward, SchedulerCall, StepGroup, TrainedInEval, ZeroGradBeforeStep
from torchkeel.introspect.sites import is_user_file, site_text, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

_BN = torch.nn.modules.batchnorm._BatchNorm
_DROPOUT = torch.nn.modules.dropout._DropoutNd
_SCALED = ("DivBackward", "MulBackward")  # a loss divided (or multiplied) before its backward
_HORIZONS = ("step_size", "milestones", "T_max", "total_iters", "gamma")
_STEPS_KEPT = 200


class LoopListener:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.backward_at: dict[str, Any] | None = None  # the last backward since the last step
        self.zeroed: list[tuple[set[int], dict[str, Any] | None]] = []  # zero_grad calls after that backward
        self.clips: list[tuple[str, dict[str, Any] | None, int]] = []  # (function, site, backwards before it)
        self.backwards = 0  # since the last step
        self.batches = 0  # fetched since the last step
        self.calls = 0  # model calls with gradients on since the last step (a micro-batch each, without a loader)
        self.roots_scaled: list[bool] = []  # per backward since the last step: was the loss divided first
        self.groups: list[dict[str, Any]] = []  # per step: backwards, batches, all unscaled, the backward site
        self.schedulers: dict[int, dict[str, Any]] = {}
        self.grad_roots: dict[int, torch.nn.Module] = {}  # models called with gradients on since the last step
        self.modes: dict[int, dict[str, Any]] = {}  # per model: when it trained in train mode, then in eval
        self.eval_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its last eval() call
        self.mode_calls = 0

    def install(self) -> None:
        probe = self.probe
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            for name in ("clip_grad_norm_", "clip_grad_value_"):
                if name in vars(owner):
                    probe.patch(owner, name, self._clipping(getattr(owner, name)))
        scheduler = torch.optim.lr_scheduler.LRScheduler
        probe.patch(scheduler, "step", self._scheduling(scheduler.step))
        probe.patch(torch.nn.Module, "train", self._moding(torch.nn.Module.train))

    # ---------------------------------------------------------------- fed by the other listeners
    def on_backward_done(self, roots: list[torch.Tensor]) -> None:
        if self.probe.state.in_step:
            return  # a closure's backward (LBFGS) runs inside the step: not part of the loop's order
        self.backward_at = user_site()
        self.zeroed = []
        self.backwards += 1
        grad_fn = roots[0].grad_fn if roots else None
        self.roots_scaled.append(grad_fn is not None and type(grad_fn).__name__.startswith(_SCALED))

    def on_zero_grad(self, owner: Any) -> None:
        """A ``zero_grad()`` after a backward and before any step: which gradients it cleared."""
        if self.backwards == 0 or self.probe.state.in_step:
            return
        if isinstance(owner, torch.optim.Optimizer):
            params = {id(p) for g in owner.param_groups for p in g["params"]}
        else:
            params = {id(p) for p in owner.parameters()}
        self.zeroed.append((params, user_site()))

    def on_fetched(self) -> None:
        self.batches += 1

    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.grad_roots[id(module)] = module
            self.calls += 1

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        probe, step = self.probe, self.probe.next_step
        site = user_site()
        cleared = None
        if self.backwards and self.zeroed:  # the parameter set only when a zero_grad followed a backward
            trainable = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
            cleared = next((s for params, s in self.zeroed if params & trainable), None)
        if cleared is not None:
            probe.record(
                "zero-grad-before-step",
                ZeroGradBeforeStep(
                    step=step,
                    optimizer=type(optimizer).__name__,
                    backward_at=site_text(self.backward_at),
                    step_at=site_text(site),
                    **(cleared or {}),
                ),
            )
        early = [(name, s) for name, s, before in self.clips if before == 0]
        if self.backwards and early and len(early) == len(self.clips):
            probe.record(
                "clip-before-backward",
                ClipBeforeBackward(
                    step=step,
                    call=early[0][0],
                    backward_at=site_text(self.backward_at),
                    step_at=site_text(site),
                    **(early[0][1] or {}),
                ),
            )
        if self.backwards and len(self.groups) < _STEPS_KEPT:
            self.groups.append(
                {
                    "step": step,
                    "backwards": self.backwards,
                    "batches": self.batches,
                    "calls": self.calls,
                    "unscaled": not any(self.roots_scaled),
                    "backward_at": self.backward_at,
                }
            )
        self._note_modes(step)
        self.backwards, self.batches, self.calls, self.clips, self.zeroed, self.roots_scaled = 0, 0, 0, [], [], []

    def _note_modes(self, step: int) -> None:
        for key, module in self.grad_roots.items():
            record = self.modes.get(key)
            if record is None:
                layers = [
                    self.probe.name_of(m)
                    for m in module.modules()
                    if (isinstance(m, _DROPOUT) and m.p > 0) or isinstance(m, _BN)
                ]
                if not layers:
                    continue
                record = self.modes[key] = {"module": module, "layers": layers, "trained_until": None, "eval": []}
            if module.training:
                record["trained_until"], record["eval"] = step, []
            elif record["trained_until"] is not None or record["eval"] or _not_chosen(self.eval_sites.get(module, {})):
                if not record["eval"]:
                    record["since"] = dict(self.eval_sites.get(module, {}))  # the eval() that began it
                record["eval"].append(step)  # after training in train mode, or after an eval() nobody chose
        self.grad_roots = {}

    # ---------------------------------------------------------------- wrapped here
    def _clipping(self, original: Callable) -> Callable:
        listener = self

        def clip(*args: Any, **kwargs: Any) -> Any:
            if not listener.probe.state.busy:
                listener.clips.append((original.__name__, user_site(), listener.backwards))
            return original(*args, **kwargs)

        clip.__name__ = clip.__qualname__ = original.__name__
        clip.__doc__ = original.__doc__
        return clip

    def _scheduling(self, original: Callable) -> Callable:
        listener = self

        def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            user = getattr(scheduler, "_step_count", 0) > 0 and not listener.probe.state.busy  # not __init__'s step
            result = original(scheduler, *args, **kwargs)
            if user:
                listener.probe.safely(listener._scheduled, scheduler)
            return result

        return step

    def _scheduled(self, scheduler: Any) -> None:
        probe = self.probe
        record = self.schedulers.get(id(scheduler))
        loader = probe.state.last_loader
        lrs = [float(g["lr"]) for g in scheduler.optimizer.param_groups]
        if record is None:
            record = self.schedulers[id(scheduler)] = {
                "scheduler": type(scheduler).__name__,
                "calls": 0,
                "calls_before_step": 0,
                "first_epoch_calls": 0,
                "batches_per_epoch": loader.get("length") if loader else None,
                "horizon": {k: _plain(getattr(scheduler, k)) for k in _HORIZONS if hasattr(scheduler, k)},
                "lr_set": float(scheduler.base_lrs[0]) if getattr(scheduler, "base_lrs", None) else lrs[0],
                "lr_first_epoch_min": lrs[0],
                "lr_reached": lrs[0],
                "loader": (id(loader), loader["epochs"]) if loader else None,
                **(user_site() or {}),
            }
        record["calls"] += 1
        record["lr_reached"] = lrs[0]
        stepped = any(o is scheduler.optimizer for o in probe.state.optimizers)
        if (record["calls"] == 1 and not stepped) or self.backwards:
            record["calls_before_step"] += 1  # before the optimizer's first step, or between a backward and its step
        if loader and record["loader"] == (id(loader), loader["epochs"]):
            record["first_epoch_calls"] += 1
            record["lr_first_epoch_min"] = min(record["lr_first_epoch_min"], lrs[0])

    def _moding(self, original: Callable) -> Callable:
        listener = self

        def train(module: torch.nn.Module, mode: bool = True) -> Any:
            listener.mode_calls += 1  # ``train`` recurses into every child: only the outermost is the script's
            try:
                return original(module, mode)
            finally:
                listener.mode_calls -= 1
                if listener.mode_calls == 0 and not listener.probe.state.busy and not mode:
                    # eval() under no_grad is an evaluation's (nanoGPT's estimate_loss), not a setup's; one a
                    # library makes (transformers' from_pretrained returns models in eval mode) is nobody's choice
                    caller = sys._getframe(1)
                    while caller is not None and caller.f_code.co_name in ("train", "eval"):
                        caller = caller.f_back  # Module.eval, and a library's own train() override
                    listener.eval_sites[module] = {
                        **(user_site() or {}),
                        "no_grad": not torch.is_grad_enabled(),
                        "by_library": caller is not None and not is_user_file(caller.f_code.co_filename),
                    }

        return train

    def finish(self) -> None:
        probe, events = self.probe, self.probe.facts.events
        for record in self.schedulers.values():
            record.pop("loader", None)
            probe.record("scheduler-calls", SchedulerCall(**record))
        for record in self.modes.values():
            if len(record["eval"]) >= 2:
                module = record["module"]
                called = record.get("since") or self.eval_sites.get(module, {})
                site = {k: v for k, v in called.items() if k not in ("no_grad", "by_library")}
                site["by_library"] = bool(called.get("by_library")) and record["trained_until"] is None
                probe.record(
                    "trained-in-eval",
                    TrainedInEval(
                        step=record["eval"][0],
                        steps=len(record["eval"]),
                        module=probe.name_of(module),
                        layers=record["layers"][:10],
                        trained_until=record["trained_until"],
                        **(site or {}),
                    ),
                )
        events["step-groups"] = [StepGroup(**{**g, "backward_at": site_text(g["backward_at"])}) for g in self.groups]


def _not_chosen(eval_call: dict[str, Any]) -> bool:
    """An eval() made by an evaluation (under no_grad) or by a library, not by the script's setup."""
    return bool(eval_call.get("no_grad") or eval_call.get("by_library"))


def _plain(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    try:
        return sorted(int(v) for v in value)  # MultiStepLR's milestones (a Counter)
    except (TypeError, ValueError):
        return str(value)[:80]
