"""Detectors for training that runs without an error and learns badly: the learning rate makes the
loss diverge, a graph is backpropagated twice, dropout stays on in evaluation, the classes arrive
in order, layers stay frozen at their random values. Pure functions of ``Facts``, as in
``detectors``."""

from __future__ import annotations

import math

from torchkeel.diagnose.events import DropoutAlwaysOn, OneUnitCrossEntropy, RepeatedBackward
from torchkeel.diagnose.findings import Finding, site_fields, where_text
from torchkeel.diagnose.probe import Facts
from torchkeel.diagnose.runner import ScriptOutcome

_DIVERGED = 1e3  # the loss grew this many times over its first value while still finite


def lr_divergence(f: Facts, o: ScriptOutcome) -> list[Finding]:
    """The loss climbs by orders of magnitude before anything is non-finite: the step size is too
    large for the loss surface. Named before the exploding gradients and the NaN it leads to."""
    values = []
    for x in f.losses:
        if not math.isfinite(x["value"]):
            break
        values.append(x)
    if len(values) < 3:
        return []
    first = next((abs(x["value"]) for x in values if x["value"] != 0), 0.0)
    peak = max(values, key=lambda x: x["value"])
    went_nonfinite = len(values) < len(f.losses)
    high = sum(1 for x in values if x["value"] >= 10 * first)
    if not first or peak["value"] < _DIVERGED * first or (high < 2 and not went_nonfinite):
        return []  # a single spike that training recovered from is a bad batch, not a divergence
    began = values[-1]
    for i in range(1, len(values)):
        if values[i]["value"] >= 3 * min(x["value"] for x in values[:i]) and values[i]["step"] <= peak["step"]:
            began = values[i]
            break
    climb = [x["value"] for x in values if began["step"] <= x["step"] <= peak["step"]]
    if sum(b > a for a, b in zip(climb, climb[1:])) < 0.6 * (len(climb) - 1):
        return []  # losses that drift up and down (a GAN's two players) do not climb
    record = next((r for r in f.grad_norms if r["step"] >= began["step"]), None)
    lrs = record["lrs"] if record and "lrs" in record else [lr for opt in f.optimizers for lr in opt["lrs"]]
    optimizer = f.optimizers[record["optimizer"] if record else 0]["class"] if f.optimizers else None
    lr_text = ", ".join(f"{lr:g}" for lr in lrs[:3])
    message = (
        f"the loss diverged: from {first:.4g} at step {values[0]['step']} it climbed from step {began['step']} to "
        f"{peak['value']:.3g} at step {peak['step']} ({peak['value'] / first:.3g}x) before anything was "
        f"non-finite; the learning rate is {lr_text}"
        + (f" ({optimizer})" if optimizer else "")
        + ("; the run then went non-finite" if went_nonfinite else "")
    )
    evidence = {
        "began_step": began["step"],
        "first_loss": first,
        "peak_loss": peak["value"],
        "peak_step": peak["step"],
        "growth": peak["value"] / first,
        "lrs": lrs,
        "optimizer": optimizer,
        "losses": [x["value"] for x in values[:12]],
        "went_nonfinite": went_nonfinite,
    }
    fix = (
        "Lower the learning rate (try 10x lower) or add a warmup, and clip gradients; the exploding gradients "
        "and NaN that follow are consequences."
    )
    return [Finding("lr-divergence", "error", message, evidence, fix)]


def repeated_backward(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(RepeatedBackward)
    if ev is None:
        return []
    first, again = ev["call_sites"]
    retain = " with retain_graph=True" if ev["retain_graph"] else ""
    message = (
        f"backward() ran twice through the same graph before optimizer.step(): at {first}{retain} and again at "
        f"{again}; every gradient is added twice ({f.backward_calls} backward calls for {f.steps} steps)"
    )
    evidence = {
        "step": ev["step"],
        "call_sites": ev["call_sites"],
        "retain_graph": ev["retain_graph"],
        "backward_calls": f.backward_calls,
        "optimizer_steps": f.steps,
    }
    fix = "Call backward() once per loss and step; to combine losses, add them and call backward() once (no retain_graph)."
    return [Finding("repeated-backward", "error", message, evidence, fix)]


def dropout_always_on(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(DropoutAlwaysOn)
    if ev is None:
        return []
    message = (
        f"{ev['call']}(p={ev['p']:g}) runs in {ev['module']}{where_text(ev)} while the model is in eval mode: "
        f"its training argument defaults to True, so evaluation still drops activations"
    )
    evidence = {"module": ev["module"], "call": ev["call"], "p": ev["p"], "step": ev["step"], **site_fields(ev)}
    fix = "Pass training=self.training (F.dropout(x, p, training=self.training)), or use an nn.Dropout module."
    return [Finding("dropout-always-on", "error", message, evidence, fix)]


def unshuffled_ordered_labels(f: Facts, o: ScriptOutcome) -> list[Finding]:
    """Training batches that each hold a few neighbouring classes, the classes rising from batch to
    batch: the data is stored by class and the loader does not shuffle it, so each step fits one
    or two classes. Shuffled data (every batch holds most classes) and imbalanced data (one class
    fills most batches, but it is always the same) stay quiet."""
    batches = [b for b in f.events.get("batch-labels", []) if b["size"] >= 4]
    if len(batches) < 6:
        return []
    seen = sorted({c for b in batches for c in b["classes"]})
    lows = [b["classes"][0] for b in batches]
    narrow = sorted(b.get("num_classes", len(b["classes"])) for b in batches)[len(batches) // 2] <= max(
        1, len(seen) // 3
    )
    rising = sum(1 for a, b in zip(lows, lows[1:]) if b >= a) >= 0.8 * (len(lows) - 1)
    if len(seen) < 2 or len(set(lows)) < 2 or not (narrow and rising):
        return []
    loaders = [x for x in f.data.get("loaders", []) if x.get("batches")]
    unshuffled = next((x for x in loaders if x.get("shuffle") is False), None)
    if any(x.get("shuffle") for x in loaders) and unshuffled is None:
        return []
    single = sum(1 for b in batches if b.get("num_classes", len(b["classes"])) == 1)
    message = (
        f"the first {len(batches)} training batches each hold a few neighbouring classes ({single} a single one), "
        f"rising from batch to batch (lowest class per batch: {', '.join(map(str, lows[:12]))}"
        + (", ...)" if len(lows) > 12 else ")")
        + (
            f": {unshuffled['dataset_class']} is stored by class and its DataLoader does not shuffle"
            if unshuffled
            else ""
        )
    )
    evidence = {
        "batches_checked": len(batches),
        "single_class_batches": single,
        "class_order": lows[:24],
        "dataset_class": unshuffled["dataset_class"] if unshuffled else None,
        "shuffle": False if unshuffled else None,
    }
    fix = "Shuffle the training data: DataLoader(..., shuffle=True) (or a sampler that mixes the classes)."
    return [Finding("unshuffled-ordered-labels", "error" if unshuffled else "warning", message, evidence, fix)]


def frozen_parameters(f: Facts, o: ScriptOutcome) -> list[Finding]:
    """Parameters handed to an optimizer that are frozen at their random initial values (no weights
    were ever loaded into them) while the forward pass uses them; freezing pretrained weights, or
    leaving frozen ones out of the optimizer, stays quiet."""
    frozen = f.frozen.get("parameters", [])
    if not frozen or not f.frozen.get("trainable_in_optimizers"):
        return []
    modules = list(dict.fromkeys(x["module"] for x in frozen))
    message = (
        f"{len(frozen)} parameter(s) handed to the optimizer have requires_grad=False and were never loaded from a "
        f"checkpoint: {', '.join(modules[:4])} stay at their random initial values while the forward pass uses them"
    )
    evidence = {
        "parameters": [x["parameter"] for x in frozen][:20],
        "modules": modules[:10],
        "num_frozen": len(frozen),
        "num_trainable": f.frozen["trainable_in_optimizers"],
    }
    fix = (
        "Freeze only layers you loaded pretrained weights into (check the condition that sets "
        "requires_grad=False), and leave frozen parameters out of the optimizer."
    )
    return [Finding("frozen-parameters", "warning", message, evidence, fix)]


_ONE_UNIT_FIX = (
    "For one output, use BCEWithLogitsLoss with float targets of 0 and 1; for C classes, give the last layer C "
    "outputs and pass class indices to cross entropy."
)


def _why_gradients_are_zero(f: Facts) -> str:
    """Why every gradient is zero at step(): the loss itself (a one-unit cross entropy is exactly
    0, a loss that does not change), read before guessing at the order of the calls."""
    one_unit = f.first(OneUnitCrossEntropy)
    values = {x["value"] for x in f.losses}
    if one_unit is not None:
        return (
            f"{one_unit['loss']} over a one-unit output (shape {one_unit['shape']}){where_text(one_unit)} is exactly 0 "
            "whatever the weights (the log-softmax of a single logit is 0), so every gradient is 0"
        )
    if values == {0.0}:
        return "the loss is exactly 0 at every step, so every gradient is 0"
    if len(values) == 1 and len(f.losses) >= 3:
        return f"the loss is {values.pop():.6g} at every step: it does not depend on the parameters"
    return "the gradients are zero when step() runs (is zero_grad() called between backward() and step()?)"


def params_not_updating(f: Facts, o: ScriptOutcome) -> list[Finding]:
    out = []
    for opt in f.optimizers:
        foreign = opt["num_params"] > 0 and opt["num_model_params"] == 0 and f.layer_order
        still = len(opt["moved"]) >= 2 and not any(opt["moved"])
        if not (foreign or still):
            continue
        norms = [r["total"] for r in f.grad_norms if r["optimizer"] == opt["index"]]
        if foreign:
            why = (
                "the optimizer holds tensors that are not the parameters of the model the script runs "
                "(built from a copy, or the model was rebuilt after the optimizer)"
            )
        elif opt["num_params"] and not opt["num_trainable"]:
            why = "no parameter in the optimizer requires grad (all frozen)"
        elif opt["lrs"] and all(lr == 0 for lr in opt["lrs"]):
            why = "the learning rate is 0 in every parameter group"
        elif norms and max(norms) == 0:
            why = _why_gradients_are_zero(f)
        elif len(opt["grad_none"]) == opt["num_trainable"]:
            continue  # no gradient at all: grad-none says why
        else:
            why = "the update is too small to change any value"
        message = f"{opt['class']}.step() ran {f.steps} times but the weights never changed: {why}"
        out.append(
            Finding(
                "params-not-updating",
                "error",
                message,
                {
                    "optimizer": opt["class"],
                    "optimizer_index": opt["index"],
                    "learning_rates": opt["lrs"],
                    "steps_checked": len(opt["moved"]),
                    "num_params": opt["num_params"],
                    "num_model_params": opt["num_model_params"],
                    "reason": why,
                },
                "Build the optimizer from the model you train (optimizer = SGD(model.parameters(), ...)) after the "
                "model is final, with a learning rate above 0."
                if foreign or "learning rate" in why
                else _ONE_UNIT_FIX
                if "one-unit" in why
                else "Make the loss depend on the parameters: compute it from the model's output of this step."
                if "the loss is" in why
                else "Call zero_grad() before backward() (or after step()), never between backward() and step().",
            )
        )
    return out
