"""Invariants: updates — each step moves the weights by a small fraction of their size, and
clipping rescales now and then, not always by a large factor (see ``diagnose.invariants``).

A healthy run moves each weight tensor by ``||Δw|| / ||w||`` of about 1e-3 a step (Karpathy's
rule of thumb; the largest ratio of a step stays ≥ 4e-4 through the second half of the seven
healthy public scripts of the development set, ≤ 0.03 after the first steps in the corpus). Far
below, nothing learns: an lr of 1e-9, gradients clipped to 1e-8, a schedule that sends the lr to 0
early. At 1 and above the weights are replaced rather than refined: an lr of 10, a weight decay
of 100. A clip that rescales at (nearly) every step by 10x or more sets the step size itself:
the lr in effect is ``lr * max_norm / norm``.

Measured at sampled steps only (``is_sampled``: the first five, then every 10th, every 100th
from step 1000): the step's parameters that have a gradient are copied in a step pre-hook and
compared in the post-hook, one host sync per sampled step. The clip functions are wrapped; their
norms are read at the sampled steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torchkeel.diagnose.invariants._updates_findings import (  # noqa: F401 - the family's parts, in one place
    DETECTORS,
    EXPLAINED_BY,
    FAMILY,
    clip_always,
    update_too_large,
    update_too_small,
)
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

IDS: tuple[str, ...] = ("invariant-clip-always", "invariant-update-too-small", "invariant-update-too-large")

COPY_BYTES = 2**30  # the most a sampled step copies (a large model is measured on its first tensors)


def is_sampled(step: int) -> bool:
    """The steps this family measures: 1-5, every 10th up to 1000, every 100th after."""
    return step <= 5 or (step % 10 == 0 if step <= 1000 else step % 100 == 0)


class Listener:
    """Step pre/post hooks of every optimizer and the clip functions, at sampled steps only."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.pending: dict[int, dict[str, Any]] = {}  # optimizer → what its pre-hook copied
        self.samples: list[dict[str, Any]] = []
        self.params: dict[int, torch.Tensor] = {}  # parameter id → parameter (for names at the end)
        self.step_sites: dict[int, dict[str, Any] | None] = {}  # optimizer → its step() line
        self.clips: dict[tuple, dict[str, Any]] = {}  # (function, file, line) → its sampled calls

    def install(self) -> None:
        probe = self.probe
        probe.on_exit(register_optimizer_step_pre_hook(self._step_pre).remove)
        probe.on_exit(register_optimizer_step_post_hook(self._step_post).remove)
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            for name in ("clip_grad_norm_", "clip_grad_value_"):
                if name in vars(owner):
                    probe.patch(owner, name, self._clipping(getattr(owner, name), name))

    # ---------------------------------------------------------------- updates
    def _step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.probe.state.busy and is_sampled(self.probe.next_step):
            self.probe.safely(self._copy, optimizer)

    def _step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.probe.state.busy and id(optimizer) in self.pending:
            self.probe.safely(self._compare, optimizer)

    def _copy(self, optimizer: torch.optim.Optimizer) -> None:
        params, lrs, num_bytes = [], [], 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is not None and not p.grad.is_sparse and p.numel() > 0:
                    num_bytes += p.numel() * p.element_size()
                    if num_bytes > COPY_BYTES:
                        break  # a model too large to copy whole: the parameters up to the budget
                    params.append(p)
                    lrs.append(float(group["lr"]))
        if not params:
            return
        if id(optimizer) not in self.step_sites:
            self.step_sites[id(optimizer)] = user_site()
        grad_norm = _norm_of([torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32) for p in params])
        copies = [p.detach().clone() for p in params]
        self.pending[id(optimizer)] = {
            "step": self.probe.next_step,
            "params": params,
            "lrs": lrs,
            "copies": copies,
            "grad_norm": grad_norm,
        }

    def _compare(self, optimizer: torch.optim.Optimizer) -> None:
        pending = self.pending.pop(id(optimizer))
        params, copies = pending["params"], pending["copies"]
        deltas = [torch.linalg.vector_norm(p.detach() - c, dtype=torch.float32) for p, c in zip(params, copies)]
        weights = [torch.linalg.vector_norm(c, dtype=torch.float32) for c in copies]
        device = deltas[0].device
        # One host sync per sampled step: the norms come back together.
        values = torch.stack(
            [*(d.to(device) for d in deltas), *(w.to(device) for w in weights), pending["grad_norm"].to(device)]
        ).tolist()
        n = len(params)
        self.params.update((id(p), p) for p in params)
        optimizer_index = next((i for i, o in enumerate(self.probe.state.optimizers) if o is optimizer), 0)
        self.samples.append(
            {
                "step": pending["step"],
                "optimizer": optimizer_index,
                "params": [id(p) for p in params],
                "deltas": values[:n],
                "weights": values[n : 2 * n],
                "grad_norm": values[-1],
                "lrs": pending["lrs"],
            }
        )

    # ---------------------------------------------------------------- clipping
    def _clipping(self, original: Callable, name: str) -> Callable:
        listener = self

        def clip(*args: Any, **kwargs: Any) -> Any:
            probe = listener.probe
            if probe.state.busy or not is_sampled(probe.next_step):
                return original(*args, **kwargs)
            args, kwargs = _materialised(args, kwargs)
            before: list[Any] = []
            if name == "clip_grad_value_":
                probe.safely(lambda: before.append(_grad_norm(_clip_params(args, kwargs))))
            result = original(*args, **kwargs)
            probe.safely(listener._clipped, name, args, kwargs, result, before)
            return result

        clip.__name__ = clip.__qualname__ = getattr(original, "__name__", name)
        clip.__doc__ = original.__doc__
        return clip

    def _clipped(self, name: str, args: tuple, kwargs: dict, result: Any, before: list[Any]) -> None:
        """One sampled clip call: its factor, the norm before over the norm allowed (for
        ``clip_grad_value_``, the gradients' norm before the clamp over the norm after)."""
        setting = "max_norm" if name == "clip_grad_norm_" else "clip_value"
        value = kwargs.get(setting, args[1] if len(args) > 1 else None)
        if name == "clip_grad_norm_":
            norm, limit = result, value
        elif before and before[0] is not None:
            norm, limit = before[0], _grad_norm(_clip_params(args, kwargs))
        else:
            return
        if value is None or limit is None or norm is None:
            return
        norm, limit = float(norm), float(limit)  # a host sync, at sampled steps only
        if not math.isfinite(norm):
            return
        site = user_site() or {}
        key = (name, site.get("file"), site.get("line"))
        record = self.clips.setdefault(key, {"call": name, setting: float(value), "calls": [], **site})
        factor = norm / limit if limit > 0 else (math.inf if norm > 0 else 1.0)
        record["calls"].append({"step": self.probe.next_step, "norm": norm, "factor": factor})

    def finish(self) -> None:
        names = self.probe.param_names()
        opts = self.probe.state.optimizers
        facts_params = {
            pid: {"name": names.get(pid, f"<tensor {tuple(p.shape)}>"), "dims": p.dim(), "numel": p.numel()}
            for pid, p in self.params.items()
        }
        samples = []
        for s in self.samples:
            samples.append({**s, "params": [facts_params[pid]["name"] for pid in s["params"]]})
        self.probe.facts.invariants[FAMILY] = {
            "params": {v["name"]: {"dims": v["dims"], "numel": v["numel"]} for v in facts_params.values()},
            "samples": samples,
            "optimizers": [
                {
                    "class": type(o).__name__,
                    "weight_decays": [float(g.get("weight_decay", 0.0) or 0.0) for g in o.param_groups],
                    **(self.step_sites.get(id(o)) or {}),
                }
                for o in opts
            ],
            "clips": list(self.clips.values()),
        }


def _norm_of(norms: list[torch.Tensor]) -> torch.Tensor:
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def _materialised(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The clip's arguments with its parameters as a list when they came as a generator (they
    are read twice here: once by the clip, once to measure)."""
    if args and not isinstance(args[0], (torch.Tensor, list, tuple)):
        return (list(args[0]), *args[1:]), kwargs
    params = kwargs.get("parameters")
    if params is not None and not isinstance(params, (torch.Tensor, list, tuple)):
        return args, {**kwargs, "parameters": list(params)}
    return args, kwargs


def _clip_params(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    params = args[0] if args else kwargs.get("parameters")
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params) if isinstance(params, (list, tuple)) else []


def _grad_norm(params: list[torch.Tensor]) -> torch.Tensor | None:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    return _norm_of([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads])
