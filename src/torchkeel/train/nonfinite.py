"""Diagnosis of a non-finite step: replay its batch and say where NaN/Inf first appeared.

The replay runs forward hooks on every module (the first module whose output is non-finite,
and whether its input already was), checks the batch itself (which samples carry non-finite
values), runs the backward under anomaly detection (the first backward function that produced
NaN) and lists the parameters whose gradients are non-finite. It leaves no trace: RNG states,
buffers (batch-norm statistics) and gradients are restored afterwards.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchkeel.batch import num_samples, tensors
from torchkeel.checkpoint.state import leaving_no_trace
from torchkeel.errors import first_line
from torchkeel.train.objective import Objective
from torchkeel.train.precision import Precision


def diagnose_nonfinite(
    model: torch.nn.Module,
    group: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | Objective,
    *,
    precision: Precision,
    device: torch.device,
) -> dict[str, Any]:
    """Replay ``group`` (the step's micro-batches) and return what went non-finite, as plain data.

    Keys: ``first_module``/``module_class`` (None if every module's output was finite),
    ``module_input_nonfinite``, ``input_nonfinite_samples`` (sample indices within the step),
    ``target_nonfinite_samples``, ``loss_nonfinite``, ``nonfinite_grads`` (parameter names),
    ``backward_anomaly`` (autograd's message), ``summary`` (one line for a person).
    """
    saved_grads = {name: p.grad for name, p in model.named_parameters()}
    result: dict[str, Any] = {
        "first_module": None,
        "module_class": None,
        "module_input_nonfinite": None,
        "input_nonfinite_samples": [],
        "target_nonfinite_samples": [],
        "loss_nonfinite": False,
        "nonfinite_grads": [],
        "backward_anomaly": None,
    }
    try:
        with leaving_no_trace(model):  # RNG states and batch-norm statistics as they were
            objective = Objective.of(loss_fn)
            offset = 0
            for batch in group:
                is_pair = isinstance(batch, (tuple, list)) and len(batch) == 2
                inputs, targets = batch if is_pair else (batch, None)
                result["input_nonfinite_samples"] += [offset + i for i in _bad_rows(inputs)]
                result["target_nonfinite_samples"] += [offset + i for i in _bad_rows(targets)]
                offset += num_samples(batch)
            for batch in group:
                if _replay(model, batch, objective, precision, device, result):
                    break
    finally:
        for name, p in model.named_parameters():
            p.grad = saved_grads[name]
    result["summary"] = _summary(result)
    return result


def _replay(model, batch, objective, precision, device, result) -> bool:
    """One micro-batch; True once it showed a non-finite loss or gradient."""
    names = {module: name or "<model>" for name, module in model.named_modules()}
    handles = [m.register_forward_hook(_make_hook(names[m], result)) for m in names]
    try:
        for p in model.parameters():
            p.grad = None
        with precision.autocast():
            loss = objective(model, batch, device).loss
    finally:
        for handle in handles:
            handle.remove()
    result["loss_nonfinite"] = result["loss_nonfinite"] or not bool(torch.isfinite(loss).all())
    loss.backward()
    bad = [
        name for name, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())
    ]
    result["nonfinite_grads"] = sorted(set(result["nonfinite_grads"]) | set(bad))
    if not (bad or result["loss_nonfinite"]):
        return False
    for p in model.parameters():
        p.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode warns when enabled and for every node it traces
        with torch.autograd.detect_anomaly(check_nan=True):
            with precision.autocast():
                loss = objective(model, batch, device).loss
            try:
                loss.backward()
            except RuntimeError as exc:  # anomaly mode names the backward function that made NaN
                result["backward_anomaly"] = first_line(exc)
    return True


def _make_hook(name: str, result: dict[str, Any]):
    def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if result["first_module"] is None and not _all_finite(output):
            result["first_module"] = name
            result["module_class"] = type(module).__name__
            result["module_input_nonfinite"] = not _all_finite(inputs)

    return hook


def _all_finite(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, (list, tuple)):
        return all(_all_finite(o) for o in obj)
    if isinstance(obj, dict):
        return all(_all_finite(o) for o in obj.values())
    return True


def _bad_rows(obj: Any) -> list[int]:
    """Samples (rows of dim 0) with a NaN/Inf in any floating-point tensor of ``obj``."""
    rows: set[int] = set()
    for t in tensors(obj):
        if t.is_floating_point() and t.dim() > 0:
            rows.update((~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)).nonzero().flatten().tolist())
    return sorted(rows)


def _summary(r: dict[str, Any]) -> str:
    parts = []
    if r["input_nonfinite_samples"]:
        parts.append(f"the batch itself carries NaN/Inf in samples {r['input_nonfinite_samples'][:10]}")
    if r["first_module"] is not None:
        source = "its input was already non-finite" if r["module_input_nonfinite"] else "from finite inputs"
        parts.append(f"first non-finite output: {r['first_module']} ({r['module_class']}), {source}")
    elif r["loss_nonfinite"]:
        parts.append("every module's output was finite; the loss function produced NaN/Inf")
    if r["backward_anomaly"]:
        parts.append(f"backward: {r['backward_anomaly']}")
    if r["nonfinite_grads"]:
        parts.append(
            f"non-finite gradients in {', '.join(r['nonfinite_grads'][:5])}"
            + (f" and {len(r['nonfinite_grads']) - 5} more" if len(r["nonfinite_grads"]) > 5 else "")
        )
    return "; ".join(parts) or "the replay was finite: the non-finite values did not reproduce"
