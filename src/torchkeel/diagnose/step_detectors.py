"""Detectors of what the optimizer and the gradients did: steps per backward, gradients never
zeroed, weights that do not move, missing, exploding, vanishing and non-finite gradients, and
the first module whose output went non-finite. Pure functions ``(Facts, ScriptOutcome) →
findings``, in the table of ``detectors.DETECTORS``."""

from __future__ import annotations

import math
import statistics
from typing import Any

from torchkeel.diagnose.events import (
    DoubleStep,
    LossWithoutGraph,
    NonfiniteForward,
    NonfiniteGrad,
    NonfiniteLoss,
)
from torchkeel.diagnose.findings import Finding, site_fields, where_text
from torchkeel.diagnose.probe import Facts
from torchkeel.diagnose.runner import ScriptOutcome


def double_step(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(DoubleStep)
    if ev is None:
        return []
    message = (
        f"optimizer.step() ran {ev['steps_since_backward']} times after a single backward (step {ev['step']}): "
        f"call sites {', '.join(ev['call_sites'])}"
    )
    return [
        Finding(
            "double-step",
            "error",
            message,
            {"step": ev["step"], "steps_since_backward": ev["steps_since_backward"], "call_sites": ev["call_sites"]},
            "Step the optimizer once per backward (once per accumulation group when accumulating): remove the "
            "extra optimizer.step() call.",
        )
    ]


def missing_zero_grad(f: Facts, o: ScriptOutcome) -> list[Finding]:
    if f.closure_backward_calls > f.steps >= 1 and f.closure_zero_grad_calls == 0:
        # An LBFGS-style closure evaluated several times per step, never zeroing: each evaluation
        # adds its gradient onto the last, and the line search follows the sum.
        message = (
            f"the closure passed to optimizer.step() runs backward() {f.closure_backward_calls} times in "
            f"{f.steps} steps and never calls zero_grad(): each evaluation adds its gradients onto the previous one's"
        )
        evidence = {"in_closure": True, "closure_backward_calls": f.closure_backward_calls, "optimizer_steps": f.steps}
        evidence["optimizer"] = f.optimizers[0]["class"] if f.optimizers else None
        fix = "Call optimizer.zero_grad() at the start of the closure, before the forward pass."
        return [Finding("missing-zero-grad", "error", message, evidence, fix)]
    all_checks = f.events.get("zero-grad-checks", [])
    for index in sorted({c["optimizer_index"] for c in all_checks}):
        checks = [c for c in all_checks if c["optimizer_index"] == index]
        dirty = [c for c in checks if c["param"]]
        if len(dirty) >= 2 and len(dirty) >= 0.8 * len(checks):
            break
    else:
        return []
    first = dirty[0]
    message = (
        f"each backward adds onto the gradients the previous optimizer step already used "
        f"({len(dirty)} of {len(checks)} steps, e.g. {first['param']} before step {first['step']}); "
        f"zero_grad() ran {f.zero_grad_calls} time(s) in {f.steps} steps"
    )
    return [
        Finding(
            "missing-zero-grad",
            "error",
            message,
            {
                "steps_checked": len(checks),
                "steps_with_stale_grads": len(dirty),
                "first_step": first["step"],
                "parameter": first["param"],
                "optimizer": first["optimizer"],
                "zero_grad_calls": f.zero_grad_calls,
                "optimizer_steps": f.steps,
                "in_closure": False,
            },
            "Call optimizer.zero_grad() once per optimizer step (right after optimizer.step()), on the optimizer "
            "that steps these parameters; to accumulate on purpose, divide the loss by k and step and zero every "
            "k backward calls.",
        )
    ]


def grad_none(f: Facts, o: ScriptOutcome) -> list[Finding]:
    detached = _loss_without_graph(f)
    out = [detached] if detached is not None else []
    for opt in f.optimizers:
        missing = opt["grad_none"]
        if missing and not (opt["num_params"] and opt["num_model_params"] == 0 and f.layer_order):
            out.append(_params_without_grad(f, opt, missing))
    return out


def _loss_without_graph(f: Facts) -> Finding | None:
    """``backward()`` on a loss that does not require grad, and why it does not."""
    detached = f.first(LossWithoutGraph)
    if detached is None:
        return None
    why = (
        "no parameter requires grad"
        if detached["num_params"] and not detached["num_trainable"]
        else "gradients were disabled when it was computed (torch.no_grad / inference_mode)"
        if not detached["grad_enabled"]
        else "its graph was cut (.detach(), .item(), .data, a numpy round trip, or torch.no_grad around the forward)"
    )
    return Finding(
        "grad-none",
        "error",
        f"backward() at step {detached['step']}{where_text(detached)} was called "
        f"on a loss that does not require grad: {why}",
        {
            "step": detached["step"],
            "num_params": detached["num_params"],
            "num_trainable": detached["num_trainable"],
            "reason": why,
            **site_fields(detached),
        },
        "Compute the loss from the model's output with gradients enabled and nothing detached on "
        "the way; unfreeze the parameters you train (requires_grad_(True)).",
    )


def _params_without_grad(f: Facts, opt: dict[str, Any], missing: list[dict[str, Any]]) -> Finding:
    """Trainable parameters of an optimizer with no gradient at its ``step()``, and why."""
    everything = len(missing) == opt["num_trainable"]
    if f.backward_calls == 0:
        why = "backward() is never called on the loss"
    elif everything:
        why = "backward() runs on a tensor that does not depend on these parameters"
    else:
        unused = [m["parameter"] for m in missing if not m["module_used"]]
        why = (
            f"{len(unused)} of them belong to modules that never run in forward"
            if unused
            else "their modules run, but their output does not reach the loss (detached with .detach()/.item()/"
            ".data/.numpy(), or computed and not used)"
        )
    modules = sorted({m["module"] for m in missing if m["module"]})
    severity = "error" if opt["grad_none_steps"] >= 2 or f.backward_calls == 0 else "warning"
    message = (
        f"{len(missing)} trainable parameter(s) in {opt['class']} have no gradient at optimizer.step() "
        f"(modules {', '.join(modules[:5]) or '?'}): {why}"
    )
    return Finding(
        "grad-none",
        severity,
        message,
        {
            "optimizer": opt["class"],
            "parameters": [m["parameter"] for m in missing][:20],
            "num_parameters": len(missing),
            "modules": modules[:20],
            "modules_never_used": sorted({m["module"] for m in missing if m["module"] and not m["module_used"]}),
            "steps_checked": opt["grad_none_steps"],
            "backward_calls": f.backward_calls,
            "reason": why,
        },
        "Call loss.backward() before optimizer.step()."
        if f.backward_calls == 0
        else "Make the loss depend on these modules (remove the .detach()/.item()/.data on their path, or use their "
        "output), or freeze them with requires_grad_(False) and leave them out of the optimizer.",
    )


def _trend(records: list[dict[str, Any]], key: str = "total") -> list[dict[str, Any]]:
    picks = sorted({0, len(records) // 4, len(records) // 2, (3 * len(records)) // 4, len(records) - 1})
    return [{"step": records[i]["step"], "norm": records[i][key]} for i in picks]


def grad_exploding(f: Facts, o: ScriptOutcome) -> list[Finding]:
    records = [r for r in f.grad_norms if math.isfinite(r["total"])]
    if not records:
        return []
    first = next((r["total"] for r in records if r["total"] > 0), 0.0)
    peak = max(records, key=lambda r: r["total"])
    growth = peak["total"] / first if first else 0.0
    later_bad = any(
        ev["step"] >= peak["step"] - 1 for kind in ("nonfinite-loss", "nonfinite-grad") for ev in f.events.get(kind, [])
    )
    tail = statistics.median(r["total"] for r in records[-max(1, len(records) // 4) :])
    sustained = len(records) >= 4 and first > 0 and tail >= 1e3 * first and tail >= 100
    if not (sustained or (later_bad and growth >= 100) or peak["total"] >= 1e6):
        return []  # a spike that training recovered from is not an explosion
    layers = sorted(peak["layers"].items(), key=lambda kv: -kv[1])[:5]
    rise = f"grew {growth:.3g}x from {first:.3g} at the first step to" if growth >= 10 else "reached"
    message = (
        f"gradient norm {rise} {peak['total']:.3g} at step {peak['step']}; largest in "
        f"{', '.join(n for n, _ in layers[:3])}" + ("; the run then went non-finite" if later_bad else "")
    )
    return [
        Finding(
            "grad-exploding",
            "error" if later_bad or peak["total"] >= 1e6 else "warning",
            message,
            {
                "first_norm": first,
                "peak_norm": peak["total"],
                "peak_step": peak["step"],
                "growth": growth,
                "layers": [{"layer": n, "norm": v} for n, v in layers],
                "trend": _trend(records),
                "went_nonfinite": later_bad,
            },
            "Clip gradients (torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) and lower the learning rate; "
            "check the initialisation scale of the layers named.",
        )
    ]


def nonfinite_forward(f: Facts, o: ScriptOutcome) -> list[Finding]:
    loss = f.first(NonfiniteLoss)
    ev = f.first(NonfiniteForward)
    if ev is not None and not (loss is not None or "." not in ev["module"] or o.error):
        ev = None  # a non-finite value inside the model that never reached the loss (a deliberate -inf mask)
    op = (loss or {}).get("op") or {}
    loss_op_first = (
        op.get("op") and not op.get("from_data") and (ev is None or loss["step"] < ev["step"] or ev["params_nonfinite"])
    )
    if loss_op_first:
        what = "the step's computation" if loss.get("before_backward") else "the loss"
        message = (
            f"{what} went NaN/Inf at step {loss['step']} although every module's output was finite: "
            f"{op['op']} at {op['file']}:{op['line']} turned finite values into NaN/Inf"
        )
        return [
            Finding(
                "nonfinite-forward",
                "error",
                message,
                {"module": None, "step": loss["step"], "op": op["op"], "file": op["file"], "line": op["line"]},
                _NONFINITE_FIX,
            )
        ]
    return [] if ev is None else [_nonfinite_module(ev)]


def _nonfinite_module(ev: dict[str, Any]) -> Finding:
    """The first module whose output went NaN/Inf: from non-finite parameters, or from finite inputs."""
    if ev["params_nonfinite"]:
        message = (
            f"{ev['module']} ({ev['module_class']}) output NaN/Inf at step {ev['step']} because its "
            f"parameters already are ({', '.join(ev['params_nonfinite'][:3])})"
        )
        return Finding(
            "nonfinite-forward",
            "warning",
            message,
            {
                "module": ev["module"],
                "module_class": ev["module_class"],
                "step": ev["step"],
                "parameters_nonfinite": ev["params_nonfinite"],
            },
            "The parameters went non-finite in an earlier update: clip gradients, lower the learning rate, "
            "and look for the first non-finite gradient.",
        )
    found = ev.get("op") or {}
    where = f" in {found['op']} at {found['file']}:{found['line']}" if found.get("file") else ""
    message = f"{ev['module']} ({ev['module_class']}) produced NaN/Inf from finite inputs at step {ev['step']}{where}"
    return Finding(
        "nonfinite-forward",
        "error",
        message,
        {
            "module": ev["module"],
            "module_class": ev["module_class"],
            "step": ev["step"],
            "op": found.get("op"),
            "training": ev["training"],
            "output": ev["output"],
            **site_fields(found),
        },
        _NONFINITE_FIX,
    )


_NONFINITE_FIX = (
    "Keep the op in its valid range: clamp before log/sqrt/division (torch.log(x.clamp_min(1e-8))), "
    "use log_softmax/logsumexp or a *_with_logits loss instead of a hand-written one, and raise eps in "
    "normalisation layers under fp16."
)


def nonfinite_grad(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(NonfiniteGrad)
    if ev is None:
        return []
    op = ev.get("backward_op") or {}
    where = ""
    if op.get("backward_op"):
        where = f"; the first backward op to produce it: {op['backward_op']}" + (
            f" (forward at {op['file']}:{op['line']})" if op.get("file") else ""
        )
    message = (
        f"the loss was finite but the gradients of {', '.join(ev['parameters'][:3])} went NaN/Inf in backward "
        f"at step {ev['step']}{where}"
    )
    return [
        Finding(
            "nonfinite-grad",
            "error",
            message,
            {
                "step": ev["step"],
                "parameters": ev["parameters"],
                "num_parameters": ev["num_parameters"],
                "modules": ev["modules"],
                "backward_op": op.get("backward_op"),
                **site_fields(op),
            },
            "The derivative of that op is infinite where it is evaluated (sqrt or pow at 0, norm of a zero vector, "
            "division by a tiny value): add an epsilon or clamp its input, and clip gradients.",
        )
    ]


def grad_vanishing(f: Facts, o: ScriptOutcome) -> list[Finding]:
    records = [r for r in f.grad_norms[:10] if math.isfinite(r["total"])]
    layers = [layer for layer in f.layer_order if all(layer in r["layers"] for r in records)]
    if len(records) < 2 or len(layers) < 3:
        return []
    typical = {layer: statistics.median(r["layers"][layer] for r in records) for layer in layers}
    largest = max(typical.values())
    if largest <= 0:
        return []
    earliest = layers[:2]
    ratio = min(typical[layer] for layer in earliest) / largest
    last_loss = f.losses[-1]["value"] if f.losses else 0.0
    if ratio >= 1e-5 and not (largest < 1e-9 and abs(last_loss) > 1e-4):
        return []
    message = (
        f"gradients vanish towards the input: {earliest[0]} gets a gradient norm of {typical[earliest[0]]:.3g}, "
        f"{ratio:.2g} of the largest layer's ({largest:.3g}) over the first {len(records)} steps"
    )
    return [
        Finding(
            "grad-vanishing",
            "warning",
            message,
            {
                "layers": [{"layer": layer, "norm": typical[layer]} for layer in layers][:20],
                "ratio": ratio,
                "steps_checked": len(records),
            },
            "Use non-saturating activations (ReLU/GELU) in deep stacks, a fitting initialisation (kaiming for ReLU), "
            "normalisation layers or residual connections.",
        )
    ]
