"""Optimizer steps: global step pre/post hooks and ``zero_grad`` counts.

Per optimizer: steps per backward (two steps on one backward), parameters that never get a
gradient, per-layer gradient norms, whether the weights moved, gradients left from a step that
were never zeroed; and, at a few steps, a census of the live autograd graphs (a leak).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torchkeel.diagnose.census import census
from torchkeel.diagnose.events import DoubleStep, ZeroGradCheck
from torchkeel.diagnose.probe.facts import StopScript
from torchkeel.introspect.sites import site_text, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

_CENSUS_STEPS = frozenset({1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 128, 256})
_NORM_STEPS = 200  # gradient norms of every step up to here, then of every 10th


class OptimizerListener:
    """Hooks on every optimizer's ``step``; the state is kept per optimizer (by ``id``)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.since_backward: dict[int, list[dict[str, Any] | None]] = {}  # optimizer → step sites since a backward
        self.grad_none: dict[int, list[set[int]]] = {}
        self.moved: dict[int, list[bool]] = {}
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.zero_grad_checks: list[ZeroGradCheck] = []
        self.consumed: dict[int, set[int]] = {}  # optimizer → params whose gradient it stepped with
        self.stale_params: dict[int, set[int]] = {}  # optimizer → params whose gradient adds onto a stepped one
        self.num_steps_of: dict[int, int] = {}
        self.trained = probe.state.trained  # params some optimizer stepped with a gradient (they were trained)
        self.backward_since_step = 0

    def install(self) -> None:
        self.probe.on_exit(register_optimizer_step_pre_hook(self._step_pre).remove)
        self.probe.on_exit(register_optimizer_step_post_hook(self._step_post).remove)

    def install_zero_grad(self) -> None:
        self.probe.patch(torch.optim.Optimizer, "zero_grad", self._counting(torch.optim.Optimizer.zero_grad))
        self.probe.patch(torch.nn.Module, "zero_grad", self._counting(torch.nn.Module.zero_grad))

    def on_backward_counted(self) -> None:
        self.backward_since_step += 1
        for key in self.since_backward:
            self.since_backward[key] = []

    def _counting(self, original: Callable) -> Callable:
        probe, facts = self.probe, self.probe.facts

        def zero_grad(self_: Any, *args: Any, **kwargs: Any) -> Any:
            facts.zero_grad_calls += 1
            facts.closure_zero_grad_calls += probe.state.in_step
            if not probe.state.busy:
                probe.safely(probe.emit, "zero_grad", self_)
            return original(self_, *args, **kwargs)

        return zero_grad

    def _step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        probe = self.probe
        if probe.state.busy:
            return
        probe.state.in_step = True
        if all(o is not optimizer for o in probe.state.optimizers):
            probe.state.optimizers.append(optimizer)
        if probe.light:
            return
        probe.emit("step_begins")
        probe.safely(self._inspect_step, optimizer)

    def _inspect_step(self, optimizer: torch.optim.Optimizer) -> None:
        probe = self.probe
        key, step = id(optimizer), probe.next_step
        if key not in self.num_steps_of:
            self.num_steps_of[key] = 0
            self.consumed[key], self.stale_params[key] = set(), set()
            for p in (p for g in optimizer.param_groups for p in g["params"]):
                if p.requires_grad:
                    probe.on_exit(p.register_hook(self._arrival(p, key)).remove)
        elif len(self.zero_grad_checks) < 200:
            stale = [p for g in optimizer.param_groups for p in g["params"] if id(p) in self.stale_params[key]]
            self.zero_grad_checks.append(
                ZeroGradCheck(
                    step=step,
                    optimizer=type(optimizer).__name__,
                    optimizer_index=next(i for i, o in enumerate(probe.state.optimizers) if o is optimizer),
                    param=probe.param_names().get(id(stale[0]), f"<tensor {tuple(stale[0].shape)}>") if stale else None,
                )
            )
        self.stale_params[key] = set()
        probe.emit("optimizer_step", optimizer)
        site = user_site()
        sites = self.since_backward.setdefault(key, [])
        sites.append(site)
        if len(sites) > 1 and probe.facts.backward_calls > 0:
            probe.record(
                "double-step",
                DoubleStep(
                    step=step, steps_since_backward=len(sites), call_sites=[site_text(s) for s in sites], sites=sites
                ),
            )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.trained.update(id(p) for p in params if p.grad is not None and p.requires_grad)
        history = self.grad_none.setdefault(key, [])
        if len(history) < 3:
            history.append({id(p) for p in params if p.requires_grad and p.grad is None})
        moved = self.moved.setdefault(key, [])
        if len(moved) < 5:
            self.snapshots[key] = [p.detach().clone() for p in params]
        if step <= _NORM_STEPS or step % 10 == 0:
            with_grad = [p for p in params if p.grad is not None]
            if with_grad:
                norms = torch.stack([g.detach().double().norm() for g in (p.grad for p in with_grad)]).tolist()
                probe.facts.grad_norms.append(
                    {
                        "step": step,
                        "lrs": [float(g["lr"]) for g in optimizer.param_groups],
                        "optimizer": next(i for i, o in enumerate(probe.state.optimizers) if o is optimizer),
                        "norms": dict(zip([id(p) for p in with_grad], norms)),
                    }
                )
        self.backward_since_step = 0

    def _step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        probe = self.probe
        if probe.state.busy:
            return
        probe.state.in_step = False
        probe.facts.steps += 1
        probe.state.step_nonfinite_op = None
        probe.emit("step_ends")
        if not probe.light:
            probe.safely(self._after_step, optimizer)
        if probe.facts.steps == probe.anomaly_steps and not probe.light:
            torch.autograd.set_detect_anomaly(False)
        if probe.max_steps is not None and probe.facts.steps >= probe.max_steps:
            raise StopScript(f"stopped after {probe.facts.steps} steps (--steps)")

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
        probe, facts = self.probe, self.probe.facts
        key = id(optimizer)
        self.num_steps_of[key] = self.num_steps_of.get(key, 0) + 1
        self.consumed[key] = {id(p) for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
        snapshot = self.snapshots.pop(key, None)
        if snapshot is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.moved[key].append(any(not torch.equal(a, p.detach()) for a, p in zip(snapshot, params)))
        if facts.steps in _CENSUS_STEPS:
            start = time.perf_counter()
            before = facts.censuses[-2:]
            growing = (
                len(before) == 2
                and before[0]["num_tensors"] < before[1]["num_tensors"]
                or len(before) == 2
                and before[0]["max_graph_nodes"] < before[1]["max_graph_nodes"]
            )
            roots = {id(node): made for node, made in probe.state.recent_roots}
            found, probe.state.tracked = census(
                facts.steps, probe.state.tracked, probe.state.last_census, want_holder=growing, roots=roots
            )
            probe.state.last_census = list(probe.state.tracked)
            facts.censuses.append(found)
            probe.state.overhead_s += time.perf_counter() - start

    def finish(self) -> None:
        """Each optimizer's facts, and the gradient norms summed per layer."""
        probe, f = self.probe, self.probe.facts
        names, owners = probe.param_names(), probe.owner_of()
        used_params = {
            id(p) for root, _ in probe.state.roots.values() if id(root) in probe.state.used for p in root.parameters()
        }
        for i, opt in enumerate(probe.state.optimizers):
            params = [p for g in opt.param_groups for p in g["params"]]
            history = self.grad_none.get(id(opt), [])
            never = set.intersection(*history) if history else set()
            none_params = []
            for p in params:
                if id(p) in never:
                    owner = owners.get(id(p))
                    none_params.append(
                        {
                            "parameter": names.get(id(p), f"<tensor {tuple(p.shape)}>"),
                            "module": probe.name_of(owner) if owner is not None else None,
                            "module_used": owner is not None and id(owner) in probe.state.used,
                        }
                    )
            f.optimizers.append(
                {
                    "index": i,
                    "class": type(opt).__name__,
                    "num_params": len(params),
                    "num_trainable": sum(p.requires_grad for p in params),
                    "lrs": [float(g["lr"]) for g in opt.param_groups],
                    "num_model_params": sum(id(p) in used_params for p in params),
                    "grad_none": none_params,
                    "grad_none_steps": len(history),
                    "moved": self.moved.get(id(opt), []),
                }
            )
        leaves = probe.state.leaf_order.values()
        layer_of = {id(p): probe.name_of(m) for m in leaves for p in m.parameters(recurse=False)}
        for record in f.grad_norms:
            layers: dict[str, float] = {}
            for pid, norm in record.pop("norms").items():
                layer = layer_of.get(pid, names.get(pid, "?"))
                layers[layer] = float(np.hypot(layers.get(layer, 0.0), norm))
            record["layers"] = layers
            record["total"] = float(np.sqrt(sum(v * v for v in layers.values())))
        f.events["zero-grad-checks"] = self.zero_grad_checks
