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
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.introspect.sites import site_text, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe
    from torchkeel.diagnose.probe.facts import Facts

FAMILY = "updates"
IDS: tuple[str, ...] = ("invariant-clip-always", "invariant-update-too-small", "invariant-update-too-large")

TOO_SMALL = 1e-7  # every weight tensor's ratio below this: no learning at any useful pace
SMALL = 3e-5  # ... below this, and the loss does not fall (Adam at lr 1e-7: 1e-6..1e-5; a fine-tune at 1e-5: ~1e-4)
LOSS_FALL = 0.02  # a loss that falls by less than this fraction over those steps does not fall
TOO_LARGE = 0.9  # a parameter's ratio at or above this (~1): each step replaces the weights
WEIGHT_FLOOR = 1e-6  # ||w|| below this is not judged (a zero-initialised bias or LoRA factor)
CLIP_FACTOR = 10.0  # norm / max_norm at or above this: the clip, not the lr, sets the step
CLIP_FRACTION = 0.9  # ... at this fraction of the sampled clip calls
COPY_BYTES = 2**30  # the most a sampled step copies (a large model is measured on its first tensors)
GRAD_FLOOR = 1e-3  # ||g|| / ||w|| of the whole model below this: converging, not stuck


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


# ---------------------------------------------------------------- detectors (pure: Facts → findings)
def _ratios(sample: dict[str, Any]) -> dict[str, float]:
    """Parameter name → ||Δw|| / ||w|| at one sampled step, parameters above the weight floor."""
    return {
        name: delta / weight
        for name, delta, weight in zip(sample["params"], sample["deltas"], sample["weights"])
        if weight > WEIGHT_FLOOR and math.isfinite(delta) and math.isfinite(weight)
    }


def _by_optimizer(facts: Facts) -> dict[int, list[dict[str, Any]]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for sample in facts.invariants.get(FAMILY, {}).get("samples", []):
        groups.setdefault(sample["optimizer"], []).append(sample)
    return groups


def _optimizer(facts: Facts, index: int) -> dict[str, Any]:
    opts = facts.invariants.get(FAMILY, {}).get("optimizers", [])
    return opts[index] if index < len(opts) else {}


def _large_clips(facts: Facts) -> list[dict[str, Any]]:
    """The clip calls that rescale by ≥ CLIP_FACTOR at ≥ CLIP_FRACTION of their sampled calls."""
    found = []
    for record in facts.invariants.get(FAMILY, {}).get("clips", []):
        factors = [c["factor"] for c in record["calls"]]
        if len(factors) >= 5 and sum(x >= CLIP_FACTOR for x in factors) >= CLIP_FRACTION * len(factors):
            found.append(record)
    return found


def clip_always(facts: Facts, outcome: object) -> list[Finding]:
    findings = []
    lrs = sorted({lr for s in facts.invariants.get(FAMILY, {}).get("samples", [])[-1:] for lr in s["lrs"]})
    for record in _large_clips(facts):
        factors = [c["factor"] for c in record["calls"]]
        median = statistics.median(factors)
        fraction = sum(x > 1.0 for x in factors) / len(factors)
        norms = [c["norm"] for c in record["calls"]]
        setting = "max_norm" if "max_norm" in record else "clip_value"
        message = (
            f"{record['call']}{' at ' + site_text(record) if record.get('file') else ''} rescales the gradients at "
            f"{fraction:.0%} of the sampled steps, by a median factor of {median:.3g} (gradient norm "
            f"{statistics.median(norms):.3g}, {setting} {record[setting]:.3g}): the step is the clip's, the "
            f"learning rate in effect is {1 / median:.2g} x the one set"
        )
        findings.append(
            Finding(
                "invariant-clip-always",
                "warning",
                message,
                {
                    "call": record["call"],
                    setting: record[setting],
                    "median_factor": median,
                    "fraction_rescaled": fraction,
                    "threshold_factor": CLIP_FACTOR,
                    "median_norm": statistics.median(norms),
                    "calls_sampled": len(factors),
                    "steps": [record["calls"][0]["step"], record["calls"][-1]["step"]],
                    "lrs": lrs,
                    "effective_lrs": [lr / median for lr in lrs],
                    **site_fields(record),
                },
                "Clip at a norm the gradients reach only in a spike (measure their norm first; 1.0 for most "
                "models), or scale the loss so the gradients are of that size.",
            )
        )
    return findings


def update_too_large(facts: Facts, outcome: object) -> list[Finding]:
    """A weight tensor (2-D or more) whose ratio is ≥ TOO_LARGE at ≥ 3 sampled steps. Tensors that
    start at zero (a LoRA factor, a zero-initialised head: their first steps are as large as
    they are), the layers of copies (``units.symmetric_layers``: they move as one unit) and LBFGS
    (a step() is many iterations) are left out."""
    from torchkeel.diagnose.invariants.units import symmetric_layers  # units reads this module's sampling

    symmetric = {f"{layer['module']}.{layer['param']}" for layer in symmetric_layers(facts)}
    findings = []
    for index, samples in _by_optimizer(facts).items():
        if _optimizer(facts, index).get("class") == "LBFGS":
            continue
        large = _large_updates(facts, samples, symmetric)
        if large:
            findings.append(_too_large(_optimizer(facts, index), large))
    return findings


def _large_updates(
    facts: Facts, samples: list[dict[str, Any]], left_out: set[str]
) -> dict[str, list[tuple[int, float, float]]]:
    """Weight tensor → its (step, ratio, lr) at the sampled steps where the ratio was ≥ TOO_LARGE,
    for those with ≥ 3 such steps."""
    dims = facts.invariants[FAMILY]["params"]
    seen: dict[str, list[tuple[int, float, float]]] = {}
    started_at_zero: set[str] = set()
    for sample in samples:
        lr_of = dict(zip(sample["params"], sample["lrs"]))
        ratios = _ratios(sample)
        for name in sample["params"]:
            if name not in seen and name not in ratios:
                started_at_zero.add(name)
            seen.setdefault(name, [])
        for name, ratio in ratios.items():
            if dims.get(name, {}).get("dims", 0) >= 2 and name not in started_at_zero | left_out:
                seen[name].append((sample["step"], ratio, lr_of[name]))
    return {name: hits for name, series in seen.items() if len(hits := [h for h in series if h[1] >= TOO_LARGE]) >= 3}


def _too_large(opt: dict[str, Any], large: dict[str, list[tuple[int, float, float]]]) -> Finding:
    ranked = sorted(large.items(), key=lambda kv: -statistics.median(h[1] for h in kv[1]))
    top_name, top_hits = ranked[0]
    decays = [wd for wd in opt.get("weight_decays", []) if wd > 0]
    message = (
        f"{len(large)} weight tensor(s) change by about their own size per step: {top_name} by ||dw||/||w|| = "
        f"{statistics.median(h[1] for h in top_hits):.3g} (median of {len(top_hits)} sampled steps from step "
        f"{top_hits[0][0]}; healthy runs stay near 1e-3) with {opt.get('class', 'the optimizer')} at lr "
        f"{top_hits[-1][2]:.3g}" + (f", weight decay {max(decays):.3g}" if decays else "") + _where(opt)
    )
    evidence = {
        "optimizer": opt.get("class"),
        "params": [
            {"param": name, "median_ratio": statistics.median(h[1] for h in hits), "steps": [h[0] for h in hits][:8]}
            for name, hits in ranked[:8]
        ],
        "num_params": len(large),
        "lrs": sorted({h[2] for _, hits in ranked for h in hits}),
        "weight_decays": opt.get("weight_decays", []),
        "step": top_hits[0][0],
        "threshold": TOO_LARGE,
        **site_fields(opt),
    }
    return Finding(
        "invariant-update-too-large",
        "warning",
        message,
        evidence,
        "Lower the learning rate (and the weight decay, if it is above ~0.1) until each step changes the weights by "
        "about 1e-3 of their size.",
    )


def update_too_small(facts: Facts, outcome: object) -> list[Finding]:
    """Every measured weight tensor's ratio (≥ 2-D; every parameter when there are none) below
    TOO_SMALL (or below SMALL while the loss does not fall) at every sampled step of the run's latter part (≥ 3 samples, from half-way or earlier),
    while the gradients are not what is tiny (the whole model's ||g|| / ||w|| ≥ GRAD_FLOOR: a run
    that converged moves little too), or a clip rescales them by ≥ CLIP_FACTOR."""
    findings = []
    clipped = bool(_large_clips(facts))
    for index, samples in _by_optimizer(facts).items():
        dims = facts.invariants[FAMILY]["params"]
        weights = {name for s in samples for name in s["params"] if dims.get(name, {}).get("dims", 0) >= 2}
        # Weight tensors only when there are some: a bias near zero moves by a large fraction of itself.
        judged = [
            (s, r) for s in samples if (r := {n: x for n, x in _ratios(s).items() if not weights or n in weights})
        ]
        tail = _below(judged, TOO_SMALL, samples[-1]["step"])
        threshold = TOO_SMALL
        if not tail:
            tail, threshold = _below(judged, SMALL, samples[-1]["step"]), SMALL
            if not tail or not _loss_flat(facts, tail[0][0]["step"], tail[-1][0]["step"]):
                continue
        grads = [s["grad_norm"] / math.sqrt(sum(w * w for w in s["weights"]) or 1.0) for s, _ in tail]
        if statistics.median(grads) < GRAD_FLOOR and not clipped:
            continue
        findings.append(_too_small(facts, index, samples, tail, threshold, statistics.median(grads), clipped))
    return findings


def _below(
    judged: list[tuple[dict[str, Any], dict[str, float]]], threshold: float, last_step: int
) -> list[tuple[dict[str, Any], dict[str, float]]]:
    """The latest samples whose every ratio is below ``threshold``, when there are ≥ 3 of them
    and they reach back to half-way through the run or earlier; else []."""
    tail: list[tuple[dict[str, Any], dict[str, float]]] = []
    for sample, ratios in reversed(judged):
        if max(ratios.values()) >= threshold:
            break
        tail.insert(0, (sample, ratios))
    return tail if len(tail) >= 3 and tail[0][0]["step"] - 1 <= last_step / 2 else []


def _loss_flat(facts: Facts, first_step: int, last_step: int) -> bool:
    """The losses between the two steps do not fall: the median of their last third is within
    LOSS_FALL of the median of their first third (≥ 6 losses; a slow fine-tune still falls)."""
    values = [x["value"] for x in facts.losses if first_step <= x["step"] <= last_step and math.isfinite(x["value"])]
    if len(values) < 6:
        return False
    third = len(values) // 3
    start, end = statistics.median(values[:third]), statistics.median(values[-third:])
    return start - end < LOSS_FALL * max(abs(start), 1e-12)


def _too_small(
    facts: Facts,
    index: int,
    samples: list[dict[str, Any]],
    tail: list[tuple[dict[str, Any], dict[str, float]]],
    threshold: float,
    grad_to_weight: float,
    clipped: bool,
) -> Finding:
    largest: dict[str, float] = {}
    for _, ratios in tail:
        for name, ratio in ratios.items():
            largest[name] = max(largest.get(name, 0.0), ratio)
    ranked = sorted(largest.items(), key=lambda kv: -kv[1])
    opt = _optimizer(facts, index)
    first, last = tail[0][0], tail[-1][0]
    lrs = sorted(set(last["lrs"]))
    message = (
        f"the weights hardly move: every weight tensor of {opt.get('class', 'the optimizer')} changes by less than "
        f"{threshold:g} of its norm per step from step {first['step']} to {last['step']} (largest {ranked[0][0]}, "
        f"{ranked[0][1]:.2g}; healthy runs move about 1e-3)"
        + (", and the loss does not fall" if threshold > TOO_SMALL else "")
        + f", at lr {', '.join(f'{x:.3g}' for x in lrs)}"
        + ("; a clip rescales the gradients at nearly every step" if clipped else "")
        + _where(opt)
    )
    evidence = {
        "optimizer": opt.get("class"),
        "params": [{"param": name, "max_ratio": ratio} for name, ratio in ranked[:8]],
        "num_params": len(ranked),
        "lrs": lrs,
        "first_lrs": sorted(set(samples[0]["lrs"])),
        "steps": [first["step"], last["step"]],
        "step": first["step"],
        "samples": len(tail),
        "grad_to_weight": grad_to_weight,
        "clipped": clipped,
        "threshold": threshold,
        **site_fields(opt),
    }
    return Finding(
        "invariant-update-too-small",
        "warning",
        message,
        evidence,
        "Raise the learning rate (1e-4..1e-3 for Adam, 1e-2..1e-1 for SGD), check the schedule does not reach 0 "
        "early, and clip at a norm the gradients reach only in a spike.",
    )


def _where(opt: dict[str, Any]) -> str:
    return f" (its step() at {site_text(opt)})" if opt.get("file") else ""


DETECTORS = (clip_always, update_too_large, update_too_small)
_CAUSES_OF_LARGE = {
    "lr-divergence",
    "grad-exploding",
    "input-scale",
    "nonfinite-input",
    "nonfinite-forward",
    "nonfinite-grad",
    "missing-zero-grad",
    "double-step",
    "accumulation-not-averaged",
}
EXPLAINED_BY: dict[str, set[str]] = {
    "invariant-clip-always": _CAUSES_OF_LARGE,
    "invariant-update-too-large": _CAUSES_OF_LARGE,
    "invariant-update-too-small": {
        "params-not-updating",
        "grad-none",
        "frozen-parameters",
        "grad-vanishing",
        "zero-grad-before-step",
        "scheduler-cadence",
    },
}
