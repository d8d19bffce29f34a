"""One detector per finding id: pure functions from ``Facts`` (what the probe saw) to findings.

Each detector returns a list (empty: nothing wrong). ``judge`` runs them all, drops the
findings that are consequences of another one (gradients that explode because they are never
zeroed) and orders the rest most likely root cause first.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from torchkeel.diagnose.findings import Finding, order_findings
from torchkeel.diagnose.probe import Facts
from torchkeel.diagnose.runner import ScriptOutcome

Detector = Callable[[Facts, ScriptOutcome], list[Finding]]


def _where(event: dict[str, Any]) -> str:
    return f" at {event['file']}:{event['line']}" if event.get("file") else ""


def _site(event: dict[str, Any]) -> dict[str, Any]:
    return {k: event[k] for k in ("file", "line") if event.get(k) is not None}


def nonfinite_input(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first("nonfinite-input")
    if ev is None:
        return []
    kind = "NaN" if ev.get("has_nan") else "Inf"
    target = ev.get("module") or ev.get("op")
    samples = ev.get("samples", [])
    message = (f"the data already holds {kind} before the model sees it: {ev['num_nonfinite']} value(s) in "
               f"{ev.get('num_samples', '?')} sample(s) of the batch given to {target} at step {ev['step']}"
               f" (rows {samples[:8]}" + (f", features {ev['features'][:8]}" if "features" in ev else "") + ")")
    went_bad = bool(f.first("nonfinite-loss") or o.error)
    if ev.get("module") is None and not went_bad:
        return []  # a tensor holding -inf/NaN on purpose (a mask) that never reached the loss
    severity = "error" if went_bad else "warning"
    return [Finding("nonfinite-input", severity, message, {
        "step": ev["step"], "module": ev.get("module"), "op": ev.get("op"), "argument": ev.get("argument"),
        "samples": samples, "features": ev.get("features", []), "num_nonfinite": ev["num_nonfinite"],
        "shape": ev["shape"], "has_nan": ev["has_nan"], "has_inf": ev["has_inf"], **_site(ev)},
        "Find where the dataset produces NaN/Inf for these samples (missing values, a division by zero in "
        "normalisation, log of 0) and clean or drop them before training.")]


def label_out_of_range(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first("label-out-of-range")
    if ev is None:
        return []
    if ev["loss"].startswith("binary"):
        message = (f"{ev['loss']} got target {ev['value']:g}, but binary targets must lie in [0, 1] "
                   f"({ev['num_bad_targets']} out of range at step {ev['step']}{_where(ev)})")
    else:
        message = (f"{ev['loss']} got target {ev['value']} but the model outputs {ev['num_classes']} classes "
                   f"(valid targets 0..{ev['num_classes'] - 1}; {ev['num_bad_targets']} out of range at step "
                   f"{ev['step']}{_where(ev)})")
    fix = ("Labels start at 1: subtract 1 so they run 0..C-1." if ev["min_target"] >= 1 and ev["max_target"] == ev["num_classes"]
           else "Use a multi-class loss (CrossEntropyLoss) for more than two classes, or targets in [0, 1]."
           if ev["loss"].startswith("binary") else
           "Give the output layer num_classes = max label + 1 outputs, or remap the labels to 0..C-1.")
    return [Finding("label-out-of-range", "error", message, {
        "loss": ev["loss"], "value": ev["value"], "num_classes": ev["num_classes"], "min_target": ev["min_target"],
        "max_target": ev["max_target"], "num_bad_targets": ev["num_bad_targets"], "step": ev["step"], **_site(ev)}, fix)]


def batchnorm_batch_one(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first("batchnorm-batch-one")
    if ev is None:
        return []
    loader = ev.get("loader") or {}
    why = ""
    if loader.get("dataset_size") and loader.get("batch_size"):
        why = (f": the dataset has {loader['dataset_size']} samples, batch_size={loader['batch_size']}, "
               f"drop_last={loader['drop_last']}, so the last batch holds "
               f"{loader['dataset_size'] % loader['batch_size']}")
    severity = "error" if ev["values_per_channel"] == 1 else "warning"
    message = f"a batch of one sample reached {ev['module']} in training mode at step {ev['step']}{why}"
    return [Finding("batchnorm-batch-one", severity, message, {
        "module": ev["module"], "step": ev["step"], "input_shape": ev["input_shape"],
        "values_per_channel": ev["values_per_channel"], "dataset_size": loader.get("dataset_size"),
        "batch_size": loader.get("batch_size"), "drop_last": loader.get("drop_last"), **_site(ev)},
        "Pass drop_last=True to the training DataLoader (or pick a batch size that does not leave one sample); "
        "for genuinely tiny batches use GroupNorm or LayerNorm.")]


def inplace_modified(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first("inplace-modified")
    if ev is None:
        return []
    op = ev.get("backward_op", "a backward function")
    forward = f" (its forward op is at {ev['file']}:{ev['line']}" + (f" in {ev['module']}" if ev.get("module") else "") + ")" \
        if ev.get("file") else ""
    message = f"an in-place operation modified a tensor that {op} saved for backward{forward}: {ev['error'][:160]}"
    return [Finding("inplace-modified", "error", message, {
        "backward_op": ev.get("backward_op"), "forward_op": _forward_op(ev.get("backward_op")), "module": ev.get("module"),
        "step": ev["step"], "error": ev["error"], **_site(ev)},
        "Replace the in-place op that follows this line (x += y, x.add_(), relu_(), ReLU(inplace=True), x[idx] = ...) "
        "with its out-of-place form (x = x + y), or clone() the tensor before modifying it.")]


def _forward_op(backward_op: str | None) -> str | None:
    if not backward_op:
        return None
    name = backward_op.rstrip("0123456789")
    return name[: -len("Backward")].lower() if name.endswith("Backward") else name


def double_step(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first("double-step")
    if ev is None:
        return []
    message = (f"optimizer.step() ran {ev['steps_since_backward']} times after a single backward (step {ev['step']}): "
               f"call sites {', '.join(ev['call_sites'])}")
    return [Finding("double-step", "error", message, {
        "step": ev["step"], "steps_since_backward": ev["steps_since_backward"], "call_sites": ev["call_sites"]},
        "Step the optimizer once per backward (once per accumulation group when accumulating): remove the "
        "extra optimizer.step() call.")]


def missing_zero_grad(f: Facts, o: ScriptOutcome) -> list[Finding]:
    all_checks = f.events.get("zero-grad-checks", [])
    for index in sorted({c["optimizer_index"] for c in all_checks}):
        checks = [c for c in all_checks if c["optimizer_index"] == index]
        dirty = [c for c in checks if c["param"]]
        if len(dirty) >= 2 and len(dirty) >= 0.8 * len(checks):
            break
    else:
        return []
    first = dirty[0]
    message = (f"each backward adds onto the gradients the previous optimizer step already used "
               f"({len(dirty)} of {len(checks)} steps, e.g. {first['param']} before step {first['step']}); "
               f"zero_grad() ran {f.zero_grad_calls} time(s) in {f.steps} steps")
    return [Finding("missing-zero-grad", "error", message, {
        "steps_checked": len(checks), "steps_with_stale_grads": len(dirty), "first_step": first["step"],
        "parameter": first["param"], "optimizer": first["optimizer"], "zero_grad_calls": f.zero_grad_calls,
        "optimizer_steps": f.steps},
        "Call optimizer.zero_grad() once per optimizer step (right after optimizer.step()), on the optimizer "
        "that steps these parameters; to accumulate on purpose, divide the loss by k and step and zero every "
        "k backward calls.")]


def params_not_updating(f: Facts, o: ScriptOutcome) -> list[Finding]:
    out = []
    for opt in f.optimizers:
        foreign = opt["num_params"] > 0 and opt["num_model_params"] == 0 and f.layer_order
        still = len(opt["moved"]) >= 2 and not any(opt["moved"])
        if not (foreign or still):
            continue
        norms = [r["total"] for r in f.grad_norms if r["optimizer"] == opt["index"]]
        if foreign:
            why = ("the optimizer holds tensors that are not the parameters of the model the script runs "
                   "(built from a copy, or the model was rebuilt after the optimizer)")
        elif opt["num_params"] and not opt["num_trainable"]:
            why = "no parameter in the optimizer requires grad (all frozen)"
        elif opt["lrs"] and all(lr == 0 for lr in opt["lrs"]):
            why = "the learning rate is 0 in every parameter group"
        elif norms and max(norms) == 0:
            why = "the gradients are zero when step() runs (is zero_grad() called between backward() and step()?)"
        elif len(opt["grad_none"]) == opt["num_trainable"]:
            continue  # no gradient at all: grad-none says why
        else:
            why = "the update is too small to change any value"
        message = f"{opt['class']}.step() ran {f.steps} times but the weights never changed: {why}"
        out.append(Finding("params-not-updating", "error", message, {
            "optimizer": opt["class"], "optimizer_index": opt["index"], "learning_rates": opt["lrs"],
            "steps_checked": len(opt["moved"]), "num_params": opt["num_params"],
            "num_model_params": opt["num_model_params"], "reason": why},
            "Build the optimizer from the model you train (optimizer = SGD(model.parameters(), ...)) after the "
            "model is final, with a learning rate above 0." if foreign or "learning rate" in why else
            "Call zero_grad() before backward() (or after step()), never between backward() and step()."))
    return out


def grad_none(f: Facts, o: ScriptOutcome) -> list[Finding]:
    out = []
    detached = f.first("loss-without-graph")
    if detached is not None:
        why = ("no parameter requires grad" if detached["num_params"] and not detached["num_trainable"] else
               "gradients were disabled when it was computed (torch.no_grad / inference_mode)"
               if not detached["grad_enabled"] else
               "its graph was cut (.detach(), .item(), .data, a numpy round trip, or torch.no_grad around the forward)")
        out.append(Finding("grad-none", "error", f"backward() at step {detached['step']}{_where(detached)} was called "
                           f"on a loss that does not require grad: {why}", {
                               "step": detached["step"], "num_params": detached["num_params"],
                               "num_trainable": detached["num_trainable"], "reason": why, **_site(detached)},
                           "Compute the loss from the model's output with gradients enabled and nothing detached on "
                           "the way; unfreeze the parameters you train (requires_grad_(True))."))
    for opt in f.optimizers:
        missing = opt["grad_none"]
        if not missing or (opt["num_params"] and opt["num_model_params"] == 0 and f.layer_order):
            continue
        everything = len(missing) == opt["num_trainable"]
        if f.backward_calls == 0:
            why = "backward() is never called on the loss"
        elif everything:
            why = "backward() runs on a tensor that does not depend on these parameters"
        else:
            unused = [m["parameter"] for m in missing if not m["module_used"]]
            why = (f"{len(unused)} of them belong to modules that never run in forward" if unused else
                   "their modules run, but their output does not reach the loss (detached with .detach()/.item()/"
                   ".data/.numpy(), or computed and not used)")
        modules = sorted({m["module"] for m in missing if m["module"]})
        severity = "error" if opt["grad_none_steps"] >= 2 or f.backward_calls == 0 else "warning"
        message = (f"{len(missing)} trainable parameter(s) in {opt['class']} have no gradient at optimizer.step() "
                   f"(modules {', '.join(modules[:5]) or '?'}): {why}")
        out.append(Finding("grad-none", severity, message, {
            "optimizer": opt["class"], "parameters": [m["parameter"] for m in missing][:20], "num_parameters": len(missing),
            "modules": modules[:20], "modules_never_used": sorted({m["module"] for m in missing if m["module"] and not m["module_used"]}),
            "steps_checked": opt["grad_none_steps"], "backward_calls": f.backward_calls, "reason": why},
            "Call loss.backward() before optimizer.step()." if f.backward_calls == 0 else
            "Make the loss depend on these modules (remove the .detach()/.item()/.data on their path, or use their "
            "output), or freeze them with requires_grad_(False) and leave them out of the optimizer."))
    return out


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
    later_bad = any(ev["step"] >= peak["step"] - 1 for kind in ("nonfinite-loss", "nonfinite-grad")
                    for ev in f.events.get(kind, []))
    tail = statistics.median(r["total"] for r in records[-max(1, len(records) // 4):])
    sustained = len(records) >= 4 and first > 0 and tail >= 1e3 * first and tail >= 100
    if not (sustained or (later_bad and growth >= 100) or peak["total"] >= 1e6):
        return []  # a spike that training recovered from is not an explosion
    layers = sorted(peak["layers"].items(), key=lambda kv: -kv[1])[:5]
    rise = f"grew {growth:.3g}x from {first:.3g} at the first step to" if growth >= 10 else "reached"
    message = (f"gradient norm {rise} {peak['total']:.3g} at step {peak['step']}; largest in "
               f"{', '.join(n for n, _ in layers[:3])}"
               + ("; the run then went non-finite" if later_bad else ""))
    return [Finding("grad-exploding", "error" if later_bad or peak["total"] >= 1e6 else "warning", message, {
        "first_norm": first, "peak_norm": peak["total"], "peak_step": peak["step"], "growth": growth,
        "layers": [{"layer": n, "norm": v} for n, v in layers], "trend": _trend(records), "went_nonfinite": later_bad},
        "Clip gradients (torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) and lower the learning rate; "
        "check the initialisation scale of the layers named.")]


def nonfinite_forward(f: Facts, o: ScriptOutcome) -> list[Finding]:
    loss = f.first("nonfinite-loss")
    ev = f.first("nonfinite-forward")
    if ev is not None and not (loss is not None or "." not in ev["module"] or o.error):
        ev = None  # a non-finite value inside the model that never reached the loss (a deliberate -inf mask)
    op = (loss or {}).get("op") or {}
    loss_op_first = op.get("op") and not op.get("from_data") and (ev is None or loss["step"] < ev["step"]
                                                                   or ev["params_nonfinite"])
    if loss_op_first:
        message = (f"the loss went NaN/Inf at step {loss['step']} although every module's output was finite: "
                   f"{op['op']} at {op['file']}:{op['line']} turned finite values into NaN/Inf")
        return [Finding("nonfinite-forward", "error", message, {
            "module": None, "step": loss["step"], "op": op["op"], "file": op["file"], "line": op["line"]},
            _NONFINITE_FIX)]
    if ev is None:
        return []
    if ev["params_nonfinite"]:
        message = (f"{ev['module']} ({ev['module_class']}) output NaN/Inf at step {ev['step']} because its "
                   f"parameters already are ({', '.join(ev['params_nonfinite'][:3])})")
        return [Finding("nonfinite-forward", "warning", message, {
            "module": ev["module"], "module_class": ev["module_class"], "step": ev["step"],
            "parameters_nonfinite": ev["params_nonfinite"]},
            "The parameters went non-finite in an earlier update: clip gradients, lower the learning rate, "
            "and look for the first non-finite gradient.")]
    found = ev.get("op") or {}
    where = f" in {found['op']} at {found['file']}:{found['line']}" if found.get("file") else ""
    message = f"{ev['module']} ({ev['module_class']}) produced NaN/Inf from finite inputs at step {ev['step']}{where}"
    return [Finding("nonfinite-forward", "error", message, {
        "module": ev["module"], "module_class": ev["module_class"], "step": ev["step"], "op": found.get("op"),
        "training": ev["training"], "output": ev["output"], **_site(found)}, _NONFINITE_FIX)]


_NONFINITE_FIX = ("Keep the op in its valid range: clamp before log/sqrt/division (torch.log(x.clamp_min(1e-8))), "
                  "use log_softmax/logsumexp or a *_with_logits loss instead of a hand-written one, and raise eps in "
                  "normalisation layers under fp16.")


def nonfinite_grad(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first("nonfinite-grad")
    if ev is None:
        return []
    op = ev.get("backward_op") or {}
    where = ""
    if op.get("backward_op"):
        where = f"; the first backward op to produce it: {op['backward_op']}" + \
            (f" (forward at {op['file']}:{op['line']})" if op.get("file") else "")
    message = (f"the loss was finite but the gradients of {', '.join(ev['parameters'][:3])} went NaN/Inf in backward "
               f"at step {ev['step']}{where}")
    return [Finding("nonfinite-grad", "error", message, {
        "step": ev["step"], "parameters": ev["parameters"], "num_parameters": ev["num_parameters"],
        "modules": ev["modules"], "backward_op": op.get("backward_op"), **_site(op)},
        "The derivative of that op is infinite where it is evaluated (sqrt or pow at 0, norm of a zero vector, "
        "division by a tiny value): add an epsilon or clamp its input, and clip gradients.")]


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
    message = (f"gradients vanish towards the input: {earliest[0]} gets a gradient norm of {typical[earliest[0]]:.3g}, "
               f"{ratio:.2g} of the largest layer's ({largest:.3g}) over the first {len(records)} steps")
    return [Finding("grad-vanishing", "warning", message, {
        "layers": [{"layer": layer, "norm": typical[layer]} for layer in layers][:20], "ratio": ratio,
        "steps_checked": len(records)},
        "Use non-saturating activations (ReLU/GELU) in deep stacks, a fitting initialisation (kaiming for ReLU), "
        "normalisation layers or residual connections.")]


def probabilities_into_cross_entropy(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first("probabilities-into-cross-entropy")
    if ev is None:
        return []
    softmax = bool(ev.get("produced_by")) and "Softmax" in ev["produced_by"] and "Log" not in ev["produced_by"]
    expects = "raw logits" if ev["loss"] == "cross_entropy" else "log-probabilities (log_softmax)"
    if ev["loss"] == "binary_cross_entropy_with_logits":
        softmax, expects = True, "logits (it applies the sigmoid itself)"
        message = f"{ev['loss']} received the output of a sigmoid{_where(ev)}; it expects {expects}"
    else:
        message = (f"{ev['loss']} received rows that already sum to 1 ({ev['rows']} rows of {ev['num_classes']} classes"
                   + (", the output of a softmax" if softmax else "") + f"{_where(ev)}); it expects {expects}")
    return [Finding("probabilities-into-cross-entropy", "error" if softmax else "warning", message, {
        "loss": ev["loss"], "rows": ev["rows"], "num_classes": ev["num_classes"], "produced_by": ev.get("produced_by"),
        "max_row_sum_error": ev["max_row_sum_error"], "step": ev["step"], **_site(ev)},
        "Remove the softmax before CrossEntropyLoss and pass the logits (apply softmax only for predictions); "
        "for NLLLoss use log_softmax.")]


def eval_in_train_mode(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first("eval-in-train-mode")
    if ev is None:
        return []
    ctx = "inference_mode" if ev["inference_mode"] else "no_grad"
    message = (f"{ev['module']} runs under {ctx} at {ev['file']}:{ev['line']} while still in train mode, with "
               f"{', '.join(ev['train_mode_layers'][:3])} active: dropout and batch-norm statistics change the results")
    return [Finding("eval-in-train-mode", "warning", message, {
        "module": ev["module"], "step": ev["step"], "train_mode_layers": ev["train_mode_layers"], "context": ctx,
        "calls": len(f.events.get("eval-in-train-mode", [])), **_site(ev)},
        "Call model.eval() before evaluating (and model.train() before training again).")]


def leaked_graph(f: Facts, o: ScriptOutcome) -> list[Finding]:
    reused = f.first("graph-reused")
    carried = f.first("carried-state")
    if reused is not None:
        holder = reused.get("holder")
        if carried is not None:
            holder = (f"'{carried['variable']}', " if carried.get("variable") else "") + \
                f"argument {carried['argument']} of {carried['module']}, an output of step {carried['made_at_step']}"
        held = f"; it hangs on {holder}" if holder else ""
        return [Finding("leaked-graph", "error",
                        f"backward() at step {reused['step']} reaches into the graph of an earlier step, which that "
                        f"step's backward already freed{held}", {
                            "step": reused["step"], "holder": holder, "error": reused["error"],
                            "variable": (carried or {}).get("variable"), "module": (carried or {}).get("module"),
                            **_site(carried or reused)},
                        "Detach the state carried from one step to the next (hidden = hidden.detach()) so each "
                        "step's graph ends at the step; retain_graph=True only hides this and grows memory.")]
    c = f.censuses
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
    what = (f"{counts[0]} → {counts[-1]} live tensors holding a graph" if growing_count else
            f"one autograd graph grew from {sizes[0]} to {sizes[-1]} nodes")
    message = (f"autograd graphs are kept across steps: {what} between steps {last[0]['step']} and {last[-1]['step']}"
               + (f"; held by {holder}" if holder else ""))
    return [Finding("leaked-graph", "error", message, {
        "steps": [x["step"] for x in c], "live_graph_tensors": [x["num_tensors"] for x in c],
        "largest_graph_nodes": [x["max_graph_nodes"] for x in c], "holder": holder},
        "Keep loss.item() (or tensor.detach()) for logging and running sums instead of the tensor itself; a tensor "
        "that requires grad keeps every step's graph alive.")]


def dataloader_bottleneck(f: Facts, o: ScriptOutcome) -> list[Finding]:
    data = f.data
    loaders = data.get("loaders") or []
    if not loaders or data.get("loop_s", 0) < 0.25:
        return []
    worst = max(loaders, key=lambda x: x["wait_s"])  # batches after each iterator's first
    share = data["wait_s"] / data["loop_s"]
    per_batch_ms = 1000 * worst["wait_s"] / max(worst["batches"], 1)
    if share < 0.5 or worst["batches"] < 5 or per_batch_ms < 2.0:
        return []
    compute_ms = 1000 * (data["loop_s"] - data["wait_s"]) / max(worst["batches"], 1)
    fix = (f"Load in worker processes: DataLoader(..., num_workers=N, persistent_workers=True) with N up to the CPU "
           f"cores, and move expensive work out of {worst['dataset_class']}.__getitem__ (decode or precompute once)."
           if worst["num_workers"] == 0 else
           f"{worst['dataset_class']}.__getitem__ is slower than the model even with {worst['num_workers']} workers: "
           "precompute or cache its work, or add workers if cores are free.")
    message = (f"{share:.0%} of the loop waits on data: {per_batch_ms:.1f} ms per batch from {worst['dataset_class']} "
               f"(num_workers={worst['num_workers']}) against {compute_ms:.1f} ms of compute")
    return [Finding("dataloader-bottleneck", "warning", message, {
        "dataset_class": worst["dataset_class"], "num_workers": worst["num_workers"], "batches": worst["batches"],
        "data_wait_s": round(data["wait_s"], 3), "loop_s": round(data["loop_s"], 3), "share": round(share, 3),
        "worker_startup_s": round(data.get("startup_s", 0.0), 3),
        "data_ms_per_batch": round(per_batch_ms, 2), "compute_ms_per_batch": round(compute_ms, 2)}, fix)]


def script_error(f: Facts, o: ScriptOutcome) -> list[Finding]:
    if o.error is None:
        return []
    e = o.error
    where = f" at {e['file']}:{e['line']}" if e.get("file") else ""
    return [Finding("script-error", "error", f"the script raised {e['type']}{where}: {e['message'][:200]}", {
        "type": e["type"], "message": e["message"], **({"file": e["file"], "line": e["line"]} if e.get("file") else {})},
        "Fix the error the script raised (its traceback is in the report).")]


DETECTORS: tuple[Detector, ...] = (
    nonfinite_input, label_out_of_range, batchnorm_batch_one, inplace_modified, double_step, missing_zero_grad,
    params_not_updating, grad_none, grad_exploding, nonfinite_forward, nonfinite_grad, grad_vanishing,
    probabilities_into_cross_entropy, eval_in_train_mode, leaked_graph, dataloader_bottleneck,
)


def judge(facts: Facts, outcome: ScriptOutcome, extra: list[Finding] = ()) -> list[Finding]:
    """Every finding, consequences dropped, most likely root cause first."""
    findings = [finding for detect in DETECTORS for finding in detect(facts, outcome)] + list(extra)
    ids = {x.id for x in findings}
    if ids & {"missing-zero-grad", "double-step"}:
        findings = [x for x in findings if x.id != "grad-exploding"]
    forward = next((x for x in findings if x.id == "nonfinite-forward"), None)
    data = next((x for x in findings if x.id == "nonfinite-input"), None)
    if forward and data and forward.evidence["step"] < data.evidence["step"]:
        data.severity = "warning"  # the model went non-finite before any bad batch arrived
    if not any(x.severity == "error" for x in findings):
        findings += script_error(facts, outcome)
    return order_findings(findings)
