"""One detector per finding id: pure functions from ``Facts`` (what the probe saw) to findings.

Each detector returns a list (empty: nothing wrong). ``judge`` runs them all, drops the
findings that are consequences of another one (gradients that explode because they are never
zeroed) and orders the rest most likely root cause first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchkeel.diagnose.events import (
    CarriedState,
    GraphReused,
    InplaceModified,
)
from torchkeel.diagnose.findings import Finding, forward_op_of, order_findings, site_fields
from torchkeel.diagnose.habit_detectors import (
    dropout_always_on,
    frozen_parameters,
    lr_divergence,
    params_not_updating,
    repeated_backward,
    unshuffled_ordered_labels,
)
from torchkeel.diagnose.input_detectors import (
    batchnorm_batch_one,
    dataloader_bottleneck,
    eval_in_train_mode,
    label_out_of_range,
    nonfinite_input,
    probabilities_into_cross_entropy,
)
from torchkeel.diagnose.invariants import judge_invariants
from torchkeel.diagnose.loop_detectors import LOOP_DETECTORS
from torchkeel.diagnose.probe import Facts
from torchkeel.diagnose.runner import ScriptOutcome
from torchkeel.diagnose.step_detectors import (
    double_step,
    grad_exploding,
    grad_none,
    grad_vanishing,
    missing_zero_grad,
    nonfinite_forward,
    nonfinite_grad,
)

Detector = Callable[[Facts, ScriptOutcome], list[Finding]]
# Findings that explain a later crash even as warnings: values went non-finite, then something
# downstream (sampling, an assert, a loss check) raised.
_LEADS_TO_CRASH = {"nonfinite-input", "nonfinite-forward", "nonfinite-grad", "lr-divergence", "grad-exploding"}


def inplace_modified(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(InplaceModified)
    if ev is None:
        return []
    op = ev.get("backward_op", "a backward function")
    forward = (
        f" (its forward op is at {ev['file']}:{ev['line']}" + (f" in {ev['module']}" if ev.get("module") else "") + ")"
        if ev.get("file")
        else ""
    )
    if ev.get("by_optimizer_step"):
        message = (
            f"optimizer.step() changed {ev['tensor']} in place after {op} saved it for a backward() still to "
            f"come{forward}: {ev['error'][:160]}"
        )
        fix = (
            "Run each backward() before any optimizer.step() that updates the weights its graph used (e.g. a GAN: "
            "compute the generator's loss after the discriminator's step, or step both after both backward passes)."
        )
    else:
        message = (
            f"an in-place operation modified {ev.get('tensor', 'a tensor')} that {op} saved for backward{forward}: "
            f"{ev['error'][:160]}"
        )
        fix = (
            "Replace the in-place op that follows this line (x += y, x.add_(), relu_(), ReLU(inplace=True), "
            "x[idx] = ...) with its out-of-place form (x = x + y), or clone() the tensor before modifying it."
        )
    return [
        Finding(
            "inplace-modified",
            "error",
            message,
            {
                "backward_op": ev.get("backward_op"),
                "forward_op": forward_op_of(ev.get("backward_op")),
                "module": ev.get("module"),
                "step": ev["step"],
                "error": ev["error"],
                "tensor": ev.get("tensor"),
                "by_optimizer_step": ev.get("by_optimizer_step", False),
                **site_fields(ev),
            },
            fix,
        )
    ]


def leaked_graph(f: Facts, o: ScriptOutcome) -> list[Finding]:
    """A backward into an earlier step's freed graph, graphs held across steps, or graphs that grow."""
    reused = f.first(GraphReused)
    if reused is not None:
        return [_graph_reused(reused, f.first(CarriedState))]
    spanning = next((x for x in f.censuses if x.get("backward_graphs_held", 0) >= 1), None)
    if spanning is not None:
        return [_graphs_held(spanning, f.censuses)]
    return _graphs_growing(f.censuses)


def _graph_reused(reused: dict[str, Any], carried: dict[str, Any] | None) -> Finding:
    holder = reused.get("holder")
    if carried is not None:
        holder = (
            f"'{carried['variable']}', " if carried.get("variable") else ""
        ) + f"argument {carried['argument']} of {carried['module']}, an output of step {carried['made_at_step']}"
    held = f"; it hangs on {holder}" if holder else ""
    return Finding(
        "leaked-graph",
        "error",
        f"backward() at step {reused['step']} reaches into the graph of an earlier step, which that "
        f"step's backward already freed{held}",
        {
            "step": reused["step"],
            "holder": holder,
            "error": reused["error"],
            "variable": (carried or {}).get("variable"),
            "module": (carried or {}).get("module"),
            **site_fields(carried or reused),
        },
        "Detach the state carried from one step to the next (hidden = hidden.detach()) so each "
        "step's graph ends at the step; retain_graph=True only hides this and grows memory.",
    )


def _graphs_held(spanning: dict[str, Any], c: list[dict[str, Any]]) -> Finding:
    holder = spanning["holder"]
    return Finding(
        "leaked-graph",
        "error",
        f"autograd graphs are kept across steps: after step {spanning['step']}, tensors still alive hold the "
        f"graphs of {spanning['backward_graphs_held']} backward pass(es) already run"
        + (f"; held by {holder}" if holder else ""),
        {
            "steps": [x["step"] for x in c],
            "backward_graphs_held": [x.get("backward_graphs_held", 0) for x in c],
            "largest_graph_nodes": [x["max_graph_nodes"] for x in c],
            "holder": holder,
        },
        "Keep loss.item() (or tensor.detach()) for logging and running sums instead of the tensor itself; a "
        "tensor that requires grad keeps every step's graph alive.",
    )


def _graphs_growing(c: list[dict[str, Any]]) -> list[Finding]:
    if len(c) < 4:
        return []
    last = c[-4:]
    counts = [x["num_tensors"] for x in last]
    sizes = [x["max_graph_nodes"] for x in last]
    growing_count = all(b > a for a, b in zip(counts, counts[1:])) and counts[-1] >= counts[0] + 3
    growing_graph = all(b > a for a, b in zip(sizes, sizes[1:])) and sizes[-1] >= 2 * sizes[0]
    if not (growing_count or growing_graph):
        return []
    holder = next((x["holder"] for x in reversed(c) if x["holder"]), None)
    what = (
        f"{counts[0]} → {counts[-1]} live tensors holding a graph"
        if growing_count
        else f"one autograd graph grew from {sizes[0]} to {sizes[-1]} nodes"
    )
    message = (
        f"autograd graphs are kept across steps: {what} between steps {last[0]['step']} and {last[-1]['step']}"
        + (f"; held by {holder}" if holder else "")
    )
    return [
        Finding(
            "leaked-graph",
            "error",
            message,
            {
                "steps": [x["step"] for x in c],
                "live_graph_tensors": [x["num_tensors"] for x in c],
                "largest_graph_nodes": [x["max_graph_nodes"] for x in c],
                "holder": holder,
            },
            "Keep loss.item() (or tensor.detach()) for logging and running sums instead of the tensor itself; a tensor "
            "that requires grad keeps every step's graph alive.",
        )
    ]


def script_error(f: Facts, o: ScriptOutcome) -> list[Finding]:
    if o.error is None:
        return []
    e = o.error
    where = f" at {e['file']}:{e['line']}" if e.get("file") else ""
    return [
        Finding(
            "script-error",
            "error",
            f"the script raised {e['type']}{where}: {e['message'][:200]}",
            {
                "type": e["type"],
                "message": e["message"],
                **({"file": e["file"], "line": e["line"]} if e.get("file") else {}),
            },
            "Fix the error the script raised (its traceback is in the report).",
        )
    ]


DETECTORS: tuple[Detector, ...] = (
    nonfinite_input,
    label_out_of_range,
    batchnorm_batch_one,
    unshuffled_ordered_labels,
    inplace_modified,
    repeated_backward,
    double_step,
    missing_zero_grad,
    params_not_updating,
    frozen_parameters,
    grad_none,
    lr_divergence,
    grad_exploding,
    nonfinite_forward,
    nonfinite_grad,
    grad_vanishing,
    probabilities_into_cross_entropy,
    eval_in_train_mode,
    dropout_always_on,
    leaked_graph,
    dataloader_bottleneck,
    *LOOP_DETECTORS,
)


def judge(facts: Facts, outcome: ScriptOutcome, extra: list[Finding] = ()) -> list[Finding]:
    """Every finding, consequences dropped, most likely root cause first."""
    findings = [finding for detect in DETECTORS for finding in detect(facts, outcome)] + list(extra)
    findings += judge_invariants(facts, outcome, findings)
    ids = {x.id for x in findings}
    if ids & {"missing-zero-grad", "double-step", "repeated-backward"}:
        findings = [x for x in findings if x.id not in ("grad-exploding", "lr-divergence")]
    scale = next((x for x in findings if x.id == "input-scale"), None)
    if scale is not None and ids & {"grad-exploding", "lr-divergence", "nonfinite-forward", "nonfinite-grad"}:
        scale.severity = "error"  # the inputs' scale shows in the gradients: the cause before its effects
        for x in findings:
            if x.id in ("grad-exploding", "lr-divergence"):
                x.severity = "warning"
    if "zero-grad-before-step" in ids:  # step() finds no gradients: the order says why
        findings = [x for x in findings if x.id not in ("grad-none", "params-not-updating")]
    diverged = next((x for x in findings if x.id == "lr-divergence"), None)
    if diverged is not None:
        for x in findings:
            step = x.evidence.get("step", x.evidence.get("peak_step", 0))
            if (
                x.id in ("nonfinite-forward", "nonfinite-grad", "grad-exploding")
                and step > diverged.evidence["began_step"]
            ):
                x.severity = "warning"  # how the divergence showed: its consequences
    forward = next((x for x in findings if x.id == "nonfinite-forward"), None)
    data = next((x for x in findings if x.id == "nonfinite-input"), None)
    if forward and data and forward.evidence["step"] < data.evidence["step"]:
        data.severity = "warning"  # the model went non-finite before any bad batch arrived
    crash = script_error(facts, outcome)
    if crash and any(x.severity == "error" or x.id in _LEADS_TO_CRASH for x in findings):
        # The script died of something a finding explains (an in-place change, the first module
        # that went non-finite): the root cause first, the crash it led to after it.
        return order_findings(findings) + crash
    return order_findings(findings + crash)
