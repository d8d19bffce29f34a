"""Instrumentation of an unmodified script: what its modules, optimizers, backward passes and
data loaders did, collected once as plain data (``Facts``) for the detectors to judge.

This is the one place in torchkeel that patches torch, and only while a script runs under
``keel diagnose``. Everything here observes: values are read (host syncs are fine, this is a
diagnosis) but never changed, every original function is still called with the same
arguments, and the script's own exceptions pass through untouched. What it installs:

- global module forward pre/post hooks (names, call order, non-finite outputs, inputs of the
  top-level call, BatchNorm batch sizes, no_grad calls in train mode);
- a ``TorchFunctionMode`` that looks at cross-entropy/NLL arguments and, outside modules, at
  the ops of the loss computation (the first op that turns finite values non-finite);
- a wrapper of ``torch.autograd.backward`` (losses, gradients left over from the previous
  step, non-finite gradients and the backward op that made them, in-place errors);
- global optimizer step pre/post hooks (steps per backward, parameters without gradients,
  per-layer gradient norms, whether the weights moved, censuses of live autograd graphs);
- wrappers of ``zero_grad``, the seed functions and the DataLoader iterator (time waiting on
  data).

Autograd anomaly mode (without its NaN check, which would raise where the script does not)
records the forward stack of every op during the first ``anomaly_steps`` steps, so an in-place
error or a bad gradient there can be traced to the user's line.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.overrides import TorchFunctionMode

from torchkeel.checkpoint.state import leaving_no_trace
from torchkeel.diagnose.census import census
from torchkeel.diagnose.tracing import (
    FirstNonfiniteOp,
    GradTracer,
    allocates_uninitialized,
    forward_site,
    graph_nodes,
    nonfinite_scalar,
    op_name,
)
from torchkeel.inspect.sites import (
    display_path,
    is_nonfinite,
    nonfinite_layout,
    site_text,
    tensors_in,
    user_frame,
    user_site,
    variable_name,
)

_BN = torch.nn.modules.batchnorm._BatchNorm
_DROPOUT = torch.nn.modules.dropout._DropoutNd
_CENSUS_STEPS = frozenset({1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 128, 256})
_NORM_STEPS = 200  # gradient norms of every step up to here, then of every 10th


class StopScript(BaseException):
    """Raised into the script to end it after ``--steps`` steps or ``--timeout`` seconds.

    A BaseException, so that the script's own ``except Exception`` does not swallow it."""


@dataclasses.dataclass
class Facts:
    """Everything observed, as plain data. Module and parameter names are qualified by the
    variable the script holds the model in (``model.encoder.0.weight``)."""
    steps: int = 0
    backward_calls: int = 0
    losses: list[dict[str, Any]] = dataclasses.field(default_factory=list)   # {"step", "value"}
    events: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    optimizers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    grad_norms: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {"step", "total", "layers"}
    layer_order: list[str] = dataclasses.field(default_factory=list)
    censuses: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    seeds: dict[str, Any] = dataclasses.field(default_factory=dict)
    zero_grad_calls: int = 0
    wall_s: float = 0.0

    def first(self, kind: str) -> dict[str, Any] | None:
        found = self.events.get(kind)
        return found[0] if found else None


class _Mode(TorchFunctionMode):
    """Sees every torch function call; hands the interesting ones to the probe."""
    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probe = self.probe
        if probe.busy:
            return func(*args, **kwargs)
        check = probe.loss_checks.get(func)
        if check is not None:
            probe.guarded(check, func, args, kwargs)
        out = func(*args, **kwargs)
        if not probe.stack and not probe.in_step and not probe.in_fetch:
            if isinstance(out, (torch.Tensor, tuple)):
                probe.track(out)
            if probe.watch_ops:
                probe.guarded(probe.check_op, func, args, kwargs, out)
        return out


class Probe:
    """Install with ``with Probe(...) as probe:``; read ``probe.facts`` afterwards.

    Args:
        max_steps: raise ``StopScript`` after this many optimizer steps (None: never).
        anomaly_steps: steps run with autograd anomaly mode recording forward stacks.
        light: only losses and steps (the second run of a reproducibility check).
        compiling: leave out what torch.compile cannot trace through (``keel diagnose --compile``);
            a script that calls torch.compile gets the same from that call on.
    """
    def __init__(self, *, max_steps: int | None = None, anomaly_steps: int = 2, light: bool = False,
                 compiling: bool = False) -> None:
        self.max_steps = max_steps
        self.compiling = compiling
        self._dynamo_unsafe: list[Callable[[], None]] = []
        self._mode: _Mode | None = None
        self._mode_on = True
        self.calls: list[tuple[torch.nn.Module, Any, Any]] = []  # this step's module calls, inner first
        self.anomaly_steps = anomaly_steps
        self.light = light
        self.facts = Facts()
        self.busy = False
        self.in_step = False
        self.watch_ops = True
        self.in_fetch = False
        self.last_census: list[weakref.ref] = []
        self.tracked: list[weakref.ref] = []  # tensors with a graph the probe saw made (for censuses)
        # Outputs of top-level module calls → the step that made them: an input that is one of
        # them from an earlier step is state carried across steps with its graph (an RNN's hidden).
        self.root_outputs: dict[int, tuple[weakref.ref, int]] = {}
        self.stack: list[torch.nn.Module] = []
        self.roots: dict[int, tuple[torch.nn.Module, str]] = {}
        self.used: set[int] = set()
        self.leaf_order: dict[int, torch.nn.Module] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        self.since_backward: dict[int, list[dict[str, Any] | None]] = {}
        self.backward_since_step = 0
        self.grad_none: dict[int, list[set[int]]] = {}
        self.moved: dict[int, list[bool]] = {}
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.zero_grad_checks: list[dict[str, Any]] = []
        self.consumed: dict[int, set[int]] = {}   # optimizer → params whose gradient it stepped with
        self.stale_params: dict[int, set[int]] = {}  # optimizer → params whose gradient adds onto a stepped one
        self.num_steps_of: dict[int, int] = {}
        self.step_nonfinite_op: dict[str, Any] | None = None
        self.loaders: dict[int, dict[str, Any]] = {}
        self.loader_of: dict[int, dict[str, Any]] = {}
        self.started_iters: weakref.WeakSet = weakref.WeakSet()
        self.data_startup_s = 0.0
        self.data_wait_s = 0.0
        self.first_batch_at: float | None = None
        self.last_batch_at = 0.0
        self.overhead_s = 0.0  # time the probe itself spent in the loop (censuses), not the script's
        self.started_at = 0.0
        self.loss_checks: dict[Callable, Callable] = {
            F.cross_entropy: self.check_classification, F.nll_loss: self.check_classification,
            F.binary_cross_entropy: self.check_binary, F.binary_cross_entropy_with_logits: self.check_binary}
        self._undo: list[Callable[[], None]] = []

    # ---------------------------------------------------------------- install / uninstall
    def __enter__(self) -> Probe:
        self.started_at = time.perf_counter()
        self._patch(torch.autograd, "backward", self._backward)
        self._undo.append(register_optimizer_step_pre_hook(self._step_pre).remove)
        self._undo.append(register_optimizer_step_post_hook(self._step_post).remove)
        self._patch_seeds()
        if not self.light:
            self._patch(torch, "compile", self._stepping_aside(torch.compile))
            self._patch(torch.optim.Optimizer, "zero_grad", self._counting(torch.optim.Optimizer.zero_grad))
            self._patch(torch.nn.Module, "zero_grad", self._counting(torch.nn.Module.zero_grad))
            from torch.utils.data import dataloader
            self._patch(dataloader._BaseDataLoaderIter, "__next__", self._timed_next(dataloader._BaseDataLoaderIter.__next__))
            self._patch(dataloader.DataLoader, "__iter__", self._noting_iter(dataloader.DataLoader.__iter__))
            self.facts.seeds["random_start"] = random.getstate()
            self.facts.seeds["numpy_start"] = np.random.get_state()[1].tobytes()
            if self.anomaly_steps > 0:
                previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
                torch.autograd.set_detect_anomaly(True, check_nan=False)
                self._undo.append(lambda: torch.autograd.set_detect_anomaly(*previous))
                warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
            if not self.compiling:
                mod = torch.nn.modules.module
                mode = self._mode = _Mode(self)
                mode.__enter__()
                self._dynamo_unsafe = [mod.register_module_forward_pre_hook(self._forward_pre).remove,
                                       mod.register_module_forward_hook(self._forward_post, always_call=True).remove,
                                       self._mode_off]
        return self

    def _mode_off(self) -> None:
        """Pop the function mode if it is on top (the optimizer's many small ops need no looking at)."""
        from torch.overrides import _get_current_function_mode

        if self._mode is not None and self._mode_on and _get_current_function_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._mode_on = False

    def _mode_back(self) -> None:
        if self._mode is not None and not self._mode_on and not self.compiling:
            self._mode.__enter__()
            self._mode_on = True

    def step_aside(self) -> None:
        """Remove what torch.compile cannot trace through (module hooks, the function mode): from
        here on, module-level facts (names, non-finite outputs, loss arguments) are not collected."""
        while self._dynamo_unsafe:
            try:
                self._dynamo_unsafe.pop()()
            except Exception:  # noqa: BLE001 - a mode the script pushed on top of ours cannot be popped
                pass
        self.stack.clear()
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
            self._finish()
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:  # noqa: BLE001 - undo the rest even if the mode stack was left unbalanced
                pass

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, replacement)
        self._undo.append(lambda: setattr(owner, name, original))

    def guarded(self, fn: Callable, *args: Any) -> None:
        """Run an observation; a bug in it must never break the script."""
        self.busy = True
        try:
            fn(*args)
        except StopScript:
            raise
        except Exception as exc:  # noqa: BLE001
            self.record("probe-error", {"error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            self.busy = False

    def record(self, kind: str, event: dict[str, Any], limit: int = 5) -> None:
        found = self.facts.events.setdefault(kind, [])
        if len(found) < limit:
            found.append(event)

    # ---------------------------------------------------------------- names
    def name_of(self, module: torch.nn.Module) -> str:
        for root, label in self.roots.values():
            if root is module:
                return label
        for root, label in self.roots.values():
            for name, sub in root.named_modules():
                if sub is module and name:
                    return f"{label}.{name}"
        return type(module).__name__

    def param_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for root, label in self.roots.values():
            for name, p in root.named_parameters():
                names.setdefault(id(p), f"{label}.{name}")
        return names

    def owner_of(self) -> dict[int, torch.nn.Module]:
        """Parameter id → the module that holds it directly."""
        owners: dict[int, torch.nn.Module] = {}
        for root, _ in self.roots.values():
            for sub in root.modules():
                for p in sub.parameters(recurse=False):
                    owners.setdefault(id(p), sub)
        return owners

    # ---------------------------------------------------------------- modules
    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self.busy:
            return
        if not self.stack:
            self.guarded(self._root_call, module, args)
        if isinstance(module, _BN) and module.training:
            self.guarded(self._batchnorm_input, module, args)
        self.used.add(id(module))
        self.stack.append(module)

    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.busy:
            return
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        if id(module) not in self.leaf_order and next(module.children(), None) is None and \
                next(module.parameters(recurse=False), None) is not None:
            self.leaf_order[id(module)] = module
        if not self.facts.events.get("nonfinite-forward"):
            if len(self.calls) > 20000:
                self.calls.clear()
            self.calls.append((module, args, output))
        self.track(output)
        if not self.stack:
            if not self.facts.events.get("nonfinite-forward") and any(is_nonfinite(t) for t in tensors_in(output)):
                self.guarded(self.scan_calls)
            if len(self.root_outputs) > 5000:
                self.root_outputs = {k: v for k, v in self.root_outputs.items() if v[0]() is not None}
            for t in tensors_in(output):
                if t.grad_fn is not None:
                    self.root_outputs[id(t)] = (weakref.ref(t), self.facts.steps + 1)

    def _root_call(self, module: torch.nn.Module, args: Any) -> None:
        if id(module) not in self.roots:
            frame = user_frame()
            label = variable_name(module, frame) or type(module).__name__
            self.roots[id(module)] = (module, label)
        if not torch.is_grad_enabled() and module.training and len(self.facts.events.get("eval-in-train-mode", [])) < 5:
            active = [self.name_of(m) for m in module.modules()
                      if m.training and ((isinstance(m, _DROPOUT) and m.p > 0) or isinstance(m, _BN))]
            site = user_site()
            if active and site is not None:
                self.record("eval-in-train-mode", {
                    "module": self.name_of(module), "step": self.facts.steps + 1, "train_mode_layers": active[:10],
                    "inference_mode": torch.is_inference_mode_enabled(), **site})
        for i, t in enumerate(tensors_in(args)):
            ref, made = self.root_outputs.get(id(t), (None, None))
            if ref is not None and ref() is t and t.grad_fn is not None and made <= self.facts.steps and not self.facts.events.get("carried-state"):
                self.record("carried-state", {"module": self.name_of(module), "argument": i, "made_at_step": made,
                                              "step": self.facts.steps + 1,
                                              "variable": variable_name(t, user_frame()), **(user_site() or {})})
        if not self.facts.events.get("nonfinite-input"):
            for i, t in enumerate(tensors_in(args)):
                if is_nonfinite(t) and t.grad_fn is None and not t.requires_grad:
                    self.record("nonfinite-input", {"module": self.name_of(module), "argument": i, "step": self.facts.steps + 1,
                                                    **nonfinite_layout(t), **(user_site() or {})})
                    break

    def _batchnorm_input(self, module: torch.nn.Module, args: Any) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or x.dim() < 2 or x.shape[0] != 1:
            return
        per_channel = x.numel() // max(x.shape[1], 1)
        self.record("batchnorm-batch-one", {"module": self.name_of(module), "step": self.facts.steps + 1,
                                             "input_shape": list(x.shape), "values_per_channel": per_channel,
                                             "loader": self.current_loader(), **(user_site() or {})})

    def track(self, obj: Any) -> None:
        for t in tensors_in(obj):
            if t.grad_fn is not None:
                self.tracked.append(weakref.ref(t))
        if len(self.tracked) > 50000:  # a loop without optimizer steps: keep the live ones only
            self.tracked = [r for r in self.tracked if r() is not None]

    def scan_calls(self) -> None:
        """The step went non-finite: find the first module call (inner modules finish first)
        whose output is non-finite while its inputs are finite. Outputs are checked only now, not
        on every call: a healthy run pays one check per top-level call."""
        calls, self.calls = self.calls, []
        for module, args, output in calls:
            if self.facts.events.get("nonfinite-forward"):
                break
            self._check_output(module, args, output)

    def _check_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        outs = [t for t in tensors_in(output) if t.is_floating_point()]
        if not any(is_nonfinite(t) for t in outs):
            return
        if any(is_nonfinite(t) for t in tensors_in(args)):
            return  # not where it started: an earlier op or the batch made it non-finite
        bad_params = [n for n, p in module.named_parameters() if is_nonfinite(p)]
        event = {"module": self.name_of(module), "module_class": type(module).__name__, "step": self.facts.steps + 1,
                 "params_nonfinite": bad_params[:10], "training": module.training,
                 "output": nonfinite_layout(next(t for t in outs if is_nonfinite(t)))}
        if not bad_params:
            event["op"] = self._replay_for_op(module, args)
        self.record("nonfinite-forward", event)

    def _replay_for_op(self, module: torch.nn.Module, args: Any) -> dict[str, Any] | None:
        """Run the module again on the same input under an op tracer, leaving no trace, to name the
        first op inside it whose output went non-finite from finite inputs."""

        tracer = FirstNonfiniteOp()
        try:
            with leaving_no_trace(module), torch.no_grad(), tracer:
                module(*args) if isinstance(args, tuple) else module(args)
        except Exception:  # noqa: BLE001 - a replay that fails names nothing
            pass
        return tracer.found

    # ---------------------------------------------------------------- ops outside modules
    def check_op(self, func: Callable, args: Any, kwargs: dict, out: Any) -> None:
        if self.step_nonfinite_op is not None or allocates_uninitialized(func):
            return
        outs = [t for t in tensors_in(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not outs or not any(is_nonfinite(t) for t in outs):
            return
        inputs = tensors_in(list(args) + list(kwargs.values()))
        if any(nonfinite_scalar(a) for a in list(args) + list(kwargs.values())):
            return  # deliberate: a mask filled with -inf, torch.full(..., nan)
        bad_inputs = [t for t in inputs if is_nonfinite(t)]
        site = user_site()
        if site is None:
            return
        if not bad_inputs:
            self.step_nonfinite_op = {"op": op_name(func), "step": self.facts.steps + 1, **site}
        elif all(t.grad_fn is None and not t.requires_grad for t in bad_inputs) and not self.facts.events.get("nonfinite-input"):
            self.step_nonfinite_op = {"op": op_name(func), "step": self.facts.steps + 1, "from_data": True, **site}
            self.record("nonfinite-input", {"op": op_name(func), "step": self.facts.steps + 1,
                                            **nonfinite_layout(bad_inputs[0]), **site})

    def check_classification(self, func: Callable, args: Any, kwargs: dict) -> None:
        names = ("input", "target", "weight", "size_average", "ignore_index")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        logits, target = bound.get("input"), bound.get("target")
        if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor) or logits.dim() < 1:
            return
        site = user_site() or {}
        loss = func.__name__
        num_classes = logits.shape[1] if logits.dim() >= 2 else logits.shape[0]
        if not target.is_floating_point() and target.numel():
            ignore = bound.get("ignore_index", -100)
            valid = target[target != ignore]
            if valid.numel():
                low, high = int(valid.min()), int(valid.max())
                if low < 0 or high >= num_classes:
                    bad = valid[(valid < 0) | (valid >= num_classes)]
                    self.record("label-out-of-range", {"loss": loss, "value": high if high >= num_classes else low,
                                                       "num_classes": int(num_classes), "num_bad_targets": int(bad.numel()),
                                                       "min_target": low, "max_target": high, "step": self.facts.steps + 1, **site})
        if logits.dim() >= 2 and logits.is_floating_point() and not self.facts.events.get("probabilities-into-cross-entropy"):
            x = logits.detach()
            if x.shape[1] > 1 and bool((x >= 0).all()) and float((x.sum(dim=1) - 1).abs().max()) < 1e-3:
                producer = type(logits.grad_fn).__name__ if logits.grad_fn is not None else None
                self.record("probabilities-into-cross-entropy", {
                    "loss": loss, "rows": int(x.shape[0]), "num_classes": int(x.shape[1]),
                    "max_row_sum_error": float((x.sum(dim=1) - 1).abs().max()), "produced_by": producer,
                    "step": self.facts.steps + 1, **site})

    def check_binary(self, func: Callable, args: Any, kwargs: dict) -> None:
        bound = dict(zip(("input", "target"), args))
        bound.update(kwargs)
        x, target = bound.get("input"), bound.get("target")
        if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor) or not target.numel():
            return
        site = user_site() or {}
        low, high = float(target.min()), float(target.max())
        if low < 0 or high > 1:
            self.record("label-out-of-range", {"loss": func.__name__, "value": high if high > 1 else low, "num_classes": 2,
                                               "min_target": low, "max_target": high,
                                               "num_bad_targets": int(((target < 0) | (target > 1)).sum()),
                                               "step": self.facts.steps + 1, **site})
        producer = type(x.grad_fn).__name__ if x.grad_fn is not None else None
        if func is F.binary_cross_entropy_with_logits and producer and "Sigmoid" in producer:
            self.record("probabilities-into-cross-entropy", {
                "loss": func.__name__, "rows": int(x.shape[0]) if x.dim() else 1, "num_classes": 2,
                "max_row_sum_error": None, "produced_by": producer, "step": self.facts.steps + 1, **site})

    # ---------------------------------------------------------------- backward
    def _backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        original = _ORIGINAL_BACKWARD
        if self.busy:
            return original(tensors, *args, **kwargs)
        roots = tensors_in(tensors)
        if not self.light:
            self.track(roots)
        loss_finite = True
        if roots and roots[0].numel() == 1:
            value = float(roots[0].detach())
            loss_finite = bool(np.isfinite(value))
            self.facts.losses.append({"step": self.facts.steps + 1, "value": value})
        if not self.light:
            self.guarded(self._before_backward, roots, loss_finite)
        traced = self.facts.backward_calls < 50 or self.facts.backward_calls % 20 == 0
        hooks = GradTracer(roots) if (not self.light and loss_finite and traced
                                       and not self.facts.events.get("nonfinite-grad")) else None
        try:
            result = original(tensors, *args, **kwargs)
        except RuntimeError as exc:
            text = str(exc)
            if not self.light and "modified by an inplace operation" in text:
                self.guarded(self._inplace_error, roots, exc)
            elif not self.light and "backward through the graph a second time" in text:
                self.guarded(self._graph_reused, exc)
            elif not self.light and "does not require grad and does not have a grad_fn" in text:
                params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]] or \
                    [p for root, _ in self.roots.values() for p in root.parameters()]
                self.record("loss-without-graph", {"step": self.facts.steps + 1, "grad_enabled": torch.is_grad_enabled(),
                                                   "num_params": len(params),
                                                   "num_trainable": sum(p.requires_grad for p in params),
                                                   **(user_site() or {})})
            raise
        finally:
            if hooks is not None:
                hooks.remove()
        self.facts.backward_calls += 1
        self.backward_since_step += 1
        if self.facts.backward_calls == 4 * self.anomaly_steps and not self.light:
            torch.autograd.set_detect_anomaly(False)  # a script that rarely steps: stop recording stacks
        for key in self.since_backward:
            self.since_backward[key] = []
        if not self.light and loss_finite and not self.facts.events.get("nonfinite-grad"):
            self.guarded(self._check_grads, hooks)
        return result

    def _before_backward(self, roots: list[torch.Tensor], loss_finite: bool) -> None:
        if not loss_finite:
            self.scan_calls()
            self.record("nonfinite-loss", {"step": self.facts.steps + 1, "op": self.step_nonfinite_op,
                                           "site": user_site()})
            self.watch_ops = False

    def _check_grads(self, tracer: GradTracer | None) -> None:
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]] or \
                 [p for root, _ in self.roots.values() for p in root.parameters()]
        grads = [p.grad for p in params if p.grad is not None and p.grad.is_floating_point()]
        if not grads or bool(torch.stack(torch._foreach_norm(grads)).isfinite().all()):
            return  # one fused check; a norm that overflows (huge but finite) is sorted out below
        bad = [p for p in params if p.grad is not None and is_nonfinite(p.grad)]
        if not bad:
            return
        names, owners = self.param_names(), self.owner_of()
        modules = []
        for p in bad:
            owner = owners.get(id(p))
            if owner is not None and self.name_of(owner) not in modules:
                modules.append(self.name_of(owner))
        self.record("nonfinite-grad", {"step": self.facts.steps + 1, "parameters": [names.get(id(p), "?") for p in bad][:10],
                                       "num_parameters": len(bad), "modules": modules[:10],
                                       "backward_op": tracer.found if tracer else None})

    def _inplace_error(self, roots: list[torch.Tensor], exc: RuntimeError) -> None:
        message = str(exc).split("\n")[0]
        culprit = None
        for node in graph_nodes([r.grad_fn for r in roots if r.grad_fn is not None], limit=20000):
            for attr in dir(node):
                if not attr.startswith("_saved_"):
                    continue
                try:
                    getattr(node, attr)
                except RuntimeError as err:
                    if "inplace" in str(err):
                        culprit = {"backward_op": type(node).__name__, "saved": attr[len("_saved_"):]}
                        trace = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
                        if trace:
                            culprit.update(forward_site(trace))
                        break
                except Exception:  # noqa: BLE001 - other accessors may refuse for other reasons
                    continue
            if culprit:
                break
        if culprit and culprit.get("function") == "forward":
            culprit["module"] = self._module_at(culprit)
        self.record("inplace-modified", {"step": self.facts.steps + 1, "error": message, **(culprit or {})})

    def _graph_reused(self, exc: RuntimeError) -> None:
        """backward() reached a graph an earlier backward already freed: find the tensor from an
        earlier step that this step's graph still hangs on (a hidden state carried across steps)."""
        found, _ = census(self.facts.steps + 1, self.tracked, self.last_census, want_holder=True)
        self.record("graph-reused", {"step": self.facts.steps + 1, "holder": found["holder"],
                                     "error": str(exc).split("\n")[0][:300], **(user_site() or {})})

    def _module_at(self, site: dict[str, Any]) -> str | None:
        """The module whose ``forward`` holds ``file:line``."""
        import inspect

        for root, _ in self.roots.values():
            for sub in root.modules():
                try:
                    lines, start = inspect.getsourcelines(type(sub).forward)
                    path = inspect.getsourcefile(type(sub).forward)
                except (OSError, TypeError):
                    continue
                if path and display_path(path) == site.get("file") and start <= site.get("line", -1) < start + len(lines):
                    return self.name_of(sub)
        return None

    # ---------------------------------------------------------------- optimizer
    def _step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.busy:
            return
        self.in_step = True
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        if self.light:
            return
        self._mode_off()
        self.guarded(self._inspect_step, optimizer)

    def _inspect_step(self, optimizer: torch.optim.Optimizer) -> None:
        key = id(optimizer)
        if key not in self.num_steps_of:
            self.num_steps_of[key] = 0
            self.consumed[key], self.stale_params[key] = set(), set()
            for p in (p for g in optimizer.param_groups for p in g["params"]):
                if p.requires_grad:
                    self._undo.append(p.register_hook(self._arrival(p, key)).remove)
        elif len(self.zero_grad_checks) < 200:
            stale = [p for g in optimizer.param_groups for p in g["params"] if id(p) in self.stale_params[key]]
            self.zero_grad_checks.append({
                "step": self.facts.steps + 1, "optimizer": type(optimizer).__name__,
                "optimizer_index": next(i for i, o in enumerate(self.optimizers) if o is optimizer),
                "param": self.param_names().get(id(stale[0]), f"<tensor {tuple(stale[0].shape)}>") if stale else None})
        self.stale_params[key] = set()
        site = user_site()
        sites = self.since_backward.setdefault(key, [])
        sites.append(site)
        if len(sites) > 1 and self.facts.backward_calls > 0:
            self.record("double-step", {"step": self.facts.steps + 1, "steps_since_backward": len(sites),
                                        "call_sites": [site_text(s) for s in sites], "sites": sites})
        params = [p for g in optimizer.param_groups for p in g["params"]]
        history = self.grad_none.setdefault(key, [])
        if len(history) < 3:
            history.append({id(p) for p in params if p.requires_grad and p.grad is None})
        moved = self.moved.setdefault(key, [])
        if len(moved) < 5:
            self.snapshots[key] = [p.detach().clone() for p in params]
        step = self.facts.steps + 1
        if step <= _NORM_STEPS or step % 10 == 0:
            with_grad = [p for p in params if p.grad is not None]
            if with_grad:
                norms = torch.stack([g.detach().double().norm() for g in (p.grad for p in with_grad)]).tolist()
                self.facts.grad_norms.append({"step": step, "optimizer": len(self.optimizers) - 1,
                                              "norms": dict(zip([id(p) for p in with_grad], norms))})
        self.backward_since_step = 0

    def _step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.busy:
            return
        self.in_step = False
        self.facts.steps += 1
        self.step_nonfinite_op = None
        self.calls.clear()
        if not self.light:
            self._mode_back()
            self.guarded(self._after_step, optimizer)
        if self.facts.steps == self.anomaly_steps and not self.light:
            torch.autograd.set_detect_anomaly(False)
        if self.max_steps is not None and self.facts.steps >= self.max_steps:
            raise StopScript(f"stopped after {self.facts.steps} steps (--steps)")

    def _arrival(self, p: torch.Tensor, key: int) -> Callable:
        """A gradient arrives for ``p``. If the gradient already there was stepped with and never
        zeroed, the next step of this optimizer uses a stale sum (unless it is zeroed before)."""
        def hook(grad: torch.Tensor) -> None:
            try:
                if id(p) not in self.consumed[key]:
                    return
                if p.grad is None or not bool(p.grad.ne(0).any()):
                    self.consumed[key].discard(id(p))
                    self.stale_params[key].discard(id(p))
                else:
                    self.stale_params[key].add(id(p))
            except Exception:  # noqa: BLE001 - runs inside the script's backward: never raise there
                pass
        return hook

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        key = id(optimizer)
        self.num_steps_of[key] = self.num_steps_of.get(key, 0) + 1
        self.consumed[key] = {id(p) for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
        snapshot = self.snapshots.pop(key, None)
        if snapshot is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.moved[key].append(any(not torch.equal(a, p.detach()) for a, p in zip(snapshot, params)))
        if self.facts.steps in _CENSUS_STEPS:
            start = time.perf_counter()
            before = self.facts.censuses[-2:]
            growing = len(before) == 2 and before[0]["num_tensors"] < before[1]["num_tensors"] or \
                len(before) == 2 and before[0]["max_graph_nodes"] < before[1]["max_graph_nodes"]
            found, self.tracked = census(self.facts.steps, self.tracked, self.last_census, want_holder=growing)
            self.last_census = list(self.tracked)
            self.facts.censuses.append(found)
            self.overhead_s += time.perf_counter() - start

    # ---------------------------------------------------------------- data, seeds, zero_grad
    def _counting(self, original: Callable) -> Callable:
        probe = self

        def zero_grad(self_: Any, *args: Any, **kwargs: Any) -> Any:
            probe.facts.zero_grad_calls += 1
            return original(self_, *args, **kwargs)

        return zero_grad

    def _timed_next(self, original: Callable) -> Callable:
        probe = self

        def __next__(it: Any) -> Any:
            start = time.perf_counter()
            probe.in_fetch = True
            try:
                return original(it)
            finally:
                probe.in_fetch = False
                waited = time.perf_counter() - start
                probe.data_wait_s += waited
                if probe.first_batch_at is None:
                    probe.first_batch_at, probe.overhead_s = start, 0.0
                probe.last_batch_at = time.perf_counter()
                probe._note_loader(it, waited)

        return __next__

    def _noting_iter(self, original: Callable) -> Callable:
        probe = self

        def __iter__(loader: Any) -> Any:
            it = original(loader)
            if id(loader) not in probe.loaders:
                try:
                    size = len(loader.dataset)
                except TypeError:
                    size = None
                probe.loaders[id(loader)] = {
                    "dataset_class": type(loader.dataset).__name__, "dataset_size": size,
                    "batch_size": loader.batch_size, "drop_last": loader.drop_last,
                    "num_workers": loader.num_workers, "batches": 0, "wait_s": 0.0}
            probe.loader_of[id(it)] = probe.loaders[id(loader)]
            return it

        return __iter__

    def _note_loader(self, it: Any, waited: float) -> None:
        info = self.loader_of.get(id(it))
        if info is None:
            return
        self.last_loader = info
        if info["num_workers"] and it not in self.started_iters:
            # The first batch of an iterator includes starting its workers: counted apart, as
            # startup, not as the Dataset's speed.
            self.started_iters.add(it)
            self.data_startup_s += waited
            info["startup_s"] = info.get("startup_s", 0.0) + waited
            return
        info["batches"] += 1
        info["wait_s"] += waited
        self.last_loader = info

    last_loader: dict[str, Any] | None = None

    def current_loader(self) -> dict[str, Any] | None:
        if self.last_loader is None:
            return None
        return {k: self.last_loader[k] for k in ("dataset_class", "dataset_size", "batch_size", "drop_last")}

    def _patch_seeds(self) -> None:
        calls = self.facts.seeds.setdefault("calls", [])

        def wrap(label: str, original: Callable) -> Callable:
            def seed(*args: Any, **kwargs: Any) -> Any:
                value = args[0] if args else kwargs.get("seed")
                calls.append({"function": label, "seeded": value is not None, "site": user_site(sys._getframe(1)),
                              "value": value if isinstance(value, (int, float, str)) or value is None else repr(value)[:80]})
                result = original(*args, **kwargs)
                if label == "random.seed":
                    self.facts.seeds["random_start"] = random.getstate()
                elif label == "numpy.random.seed":
                    self.facts.seeds["numpy_start"] = np.random.get_state()[1].tobytes()
                return result
            return seed

        self._patch(random, "seed", wrap("random.seed", random.seed))
        self._patch(np.random, "seed", wrap("numpy.random.seed", np.random.seed))
        self._patch(np.random, "default_rng", wrap("numpy.random.default_rng", np.random.default_rng))
        self._patch(torch, "manual_seed", wrap("torch.manual_seed", torch.manual_seed))
        self._patch(torch.random, "manual_seed", wrap("torch.manual_seed", torch.random.manual_seed))

    # ---------------------------------------------------------------- end of run
    def _finish(self) -> None:
        f = self.facts
        f.seeds["random_used"] = random.getstate() != f.seeds.pop("random_start")
        f.seeds["numpy_used"] = np.random.get_state()[1].tobytes() != f.seeds.pop("numpy_start")
        f.events["graph-reused"] = f.events.get("graph-reused", [])
        names, owners = self.param_names(), self.owner_of()
        used_params = {id(p) for root, _ in self.roots.values() if id(root) in self.used for p in root.parameters()}
        for i, opt in enumerate(self.optimizers):
            params = [p for g in opt.param_groups for p in g["params"]]
            history = self.grad_none.get(id(opt), [])
            never = set.intersection(*history) if history else set()
            none_params = []
            for p in params:
                if id(p) in never:
                    owner = owners.get(id(p))
                    none_params.append({"parameter": names.get(id(p), f"<tensor {tuple(p.shape)}>"),
                                        "module": self.name_of(owner) if owner is not None else None,
                                        "module_used": owner is not None and id(owner) in self.used})
            f.optimizers.append({
                "index": i, "class": type(opt).__name__, "num_params": len(params),
                "num_trainable": sum(p.requires_grad for p in params),
                "lrs": [float(g["lr"]) for g in opt.param_groups],
                "num_model_params": sum(id(p) in used_params for p in params),
                "grad_none": none_params, "grad_none_steps": len(history),
                "moved": self.moved.get(id(opt), []),
            })
        order = list(self.leaf_order.values())
        f.layer_order = [self.name_of(m) for m in order]
        layer_of = {id(p): self.name_of(m) for m in order for p in m.parameters(recurse=False)}
        for record in f.grad_norms:
            layers: dict[str, float] = {}
            for pid, norm in record.pop("norms").items():
                layer = layer_of.get(pid, names.get(pid, "?"))
                layers[layer] = float(np.hypot(layers.get(layer, 0.0), norm))
            record["layers"] = layers
            record["total"] = float(np.sqrt(sum(v * v for v in layers.values())))
        loop = self.last_batch_at - self.first_batch_at - self.overhead_s - self.data_startup_s if self.first_batch_at else 0.0
        f.data = {"wait_s": self.data_wait_s - self.data_startup_s, "startup_s": self.data_startup_s,
                  "loaders": list(self.loaders.values()), "loop_s": max(0.0, loop)}
        f.events["zero-grad-checks"] = self.zero_grad_checks


_ORIGINAL_BACKWARD = torch.autograd.backward
