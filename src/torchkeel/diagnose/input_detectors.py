"""Detectors of what goes into the model and the loss: non-finite data, labels out of range,
probabilities given to a loss that wants logits, BatchNorm fed one sample, evaluation in
training mode, and a DataLoader the step waits on. Pure functions ``(Facts, ScriptOutcome) →
findings``, in the table of ``detectors.DETECTORS``."""

from __future__ import annotations

from torchkeel.diagnose.events import (
    BatchnormBatchOne,
    EvalInTrainMode,
    LabelOutOfRange,
    NonfiniteInput,
    NonfiniteLoss,
    ProbabilitiesIntoCrossEntropy,
)
from torchkeel.diagnose.findings import Finding, site_fields, where_text
from torchkeel.diagnose.probe import Facts
from torchkeel.diagnose.runner import ScriptOutcome


def nonfinite_input(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(NonfiniteInput)
    if ev is None:
        return []
    kind = "NaN" if ev.get("has_nan") else "Inf"
    target = ev.get("module") or ev.get("op")
    samples = ev.get("samples", [])
    message = (
        f"the data already holds {kind} before the model sees it: {ev['num_nonfinite']} value(s) in "
        f"{ev.get('num_samples', '?')} sample(s) of the batch given to {target} at step {ev['step']}"
        f" (rows {samples[:8]}" + (f", features {ev['features'][:8]}" if "features" in ev else "") + ")"
    )
    went_bad = bool(f.first(NonfiniteLoss) or o.error)
    if ev.get("module") is None and not went_bad:
        return []  # a tensor holding -inf/NaN on purpose (a mask) that never reached the loss
    severity = "error" if went_bad else "warning"
    return [
        Finding(
            "nonfinite-input",
            severity,
            message,
            {
                "step": ev["step"],
                "module": ev.get("module"),
                "op": ev.get("op"),
                "argument": ev.get("argument"),
                "samples": samples,
                "features": ev.get("features", []),
                "num_nonfinite": ev["num_nonfinite"],
                "shape": ev["shape"],
                "has_nan": ev["has_nan"],
                "has_inf": ev["has_inf"],
                **site_fields(ev),
            },
            "Find where the dataset produces NaN/Inf for these samples (missing values, a division by zero in "
            "normalisation, log of 0) and clean or drop them before training.",
        )
    ]


def label_out_of_range(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(LabelOutOfRange)
    if ev is None:
        return []
    if ev["loss"].startswith("binary"):
        message = (
            f"{ev['loss']} got target {ev['value']:g}, but binary targets must lie in [0, 1] "
            f"({ev['num_bad_targets']} out of range at step {ev['step']}{where_text(ev)})"
        )
    else:
        message = (
            f"{ev['loss']} got target {ev['value']} but the model outputs {ev['num_classes']} classes "
            f"(valid targets 0..{ev['num_classes'] - 1}; {ev['num_bad_targets']} out of range at step "
            f"{ev['step']}{where_text(ev)})"
        )
    fix = (
        "Labels start at 1: subtract 1 so they run 0..C-1."
        if ev["min_target"] >= 1 and ev["max_target"] == ev["num_classes"]
        else "Use a multi-class loss (CrossEntropyLoss) for more than two classes, or targets in [0, 1]."
        if ev["loss"].startswith("binary")
        else "Give the output layer num_classes = max label + 1 outputs, or remap the labels to 0..C-1."
    )
    return [
        Finding(
            "label-out-of-range",
            "error",
            message,
            {
                "loss": ev["loss"],
                "value": ev["value"],
                "num_classes": ev["num_classes"],
                "min_target": ev["min_target"],
                "max_target": ev["max_target"],
                "num_bad_targets": ev["num_bad_targets"],
                "step": ev["step"],
                **site_fields(ev),
            },
            fix,
        )
    ]


def batchnorm_batch_one(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(BatchnormBatchOne)
    if ev is None:
        return []
    loader = ev.get("loader") or {}
    why = ""
    if loader.get("dataset_size") and loader.get("batch_size"):
        why = (
            f": the dataset has {loader['dataset_size']} samples, batch_size={loader['batch_size']}, "
            f"drop_last={loader['drop_last']}, so the last batch holds "
            f"{loader['dataset_size'] % loader['batch_size']}"
        )
    severity = "error" if ev["values_per_channel"] == 1 else "warning"
    message = f"a batch of one sample reached {ev['module']} in training mode at step {ev['step']}{why}"
    return [
        Finding(
            "batchnorm-batch-one",
            severity,
            message,
            {
                "module": ev["module"],
                "step": ev["step"],
                "input_shape": ev["input_shape"],
                "values_per_channel": ev["values_per_channel"],
                "dataset_size": loader.get("dataset_size"),
                "batch_size": loader.get("batch_size"),
                "drop_last": loader.get("drop_last"),
                **site_fields(ev),
            },
            "Pass drop_last=True to the training DataLoader (or pick a batch size that does not leave one sample); "
            "for genuinely tiny batches use GroupNorm or LayerNorm.",
        )
    ]


def probabilities_into_cross_entropy(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(ProbabilitiesIntoCrossEntropy)
    if ev is None:
        return []
    softmax = bool(ev.get("produced_by")) and "Softmax" in ev["produced_by"] and "Log" not in ev["produced_by"]
    expects = "raw logits" if ev["loss"] == "cross_entropy" else "log-probabilities (log_softmax)"
    if ev["loss"] == "binary_cross_entropy_with_logits":
        softmax, expects = True, "logits (it applies the sigmoid itself)"
        message = f"{ev['loss']} received the output of a sigmoid{where_text(ev)}; it expects {expects}"
    else:
        made = where_text(ev) if ev.get("loss_at") and ev["loss_at"] != f"{ev.get('file')}:{ev.get('line')}" else ""
        message = (
            f"{ev['loss']}"
            + (f" at {ev['loss_at']}" if ev.get("loss_at") and ev["loss_at"] != "<library code>" else "")
            + f" received rows that already sum to 1 ({ev['rows']} rows of {ev['num_classes']} classes"
            + (f", the output of a softmax{made}" if softmax else "")
            + f"); it expects {expects}"
        )
    return [
        Finding(
            "probabilities-into-cross-entropy",
            "error" if softmax else "warning",
            message,
            {
                "loss": ev["loss"],
                "rows": ev["rows"],
                "num_classes": ev["num_classes"],
                "produced_by": ev.get("produced_by"),
                "max_row_sum_error": ev["max_row_sum_error"],
                "step": ev["step"],
                "loss_at": ev.get("loss_at"),
                **site_fields(ev),
            },
            "Remove the softmax before CrossEntropyLoss and pass the logits (apply softmax only for predictions); "
            "for NLLLoss use log_softmax.",
        )
    ]


def eval_in_train_mode(f: Facts, o: ScriptOutcome) -> list[Finding]:
    ev = f.first(EvalInTrainMode)
    if ev is None:
        return []
    ctx = "inference_mode" if ev["inference_mode"] else "no_grad"
    message = (
        f"{ev['module']} runs under {ctx} at {ev['file']}:{ev['line']} while still in train mode, with "
        f"{', '.join(ev['train_mode_layers'][:3])} active: dropout and batch-norm statistics change the results"
    )
    return [
        Finding(
            "eval-in-train-mode",
            "warning",
            message,
            {
                "module": ev["module"],
                "step": ev["step"],
                "train_mode_layers": ev["train_mode_layers"],
                "context": ctx,
                "calls": len(f.events.get("eval-in-train-mode", [])),
                **site_fields(ev),
            },
            "Call model.eval() before evaluating (and model.train() before training again).",
        )
    ]


_BOTTLENECK_SHARE = 2 / 3


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
    fix = (
        f"Load in worker processes: DataLoader(..., num_workers=N, persistent_workers=True) with N up to the CPU "
        f"cores, and move expensive work out of {worst['dataset_class']}.__getitem__ (decode or precompute once)."
        if worst["num_workers"] == 0
        else f"{worst['dataset_class']}.__getitem__ is slower than the model even with {worst['num_workers']} workers: "
        "precompute or cache its work, or add workers if cores are free."
    )
    message = (
        f"{share:.0%} of the loop waits on data: {per_batch_ms:.1f} ms per batch from {worst['dataset_class']} "
        f"(num_workers={worst['num_workers']}) against {compute_ms:.1f} ms of compute"
    )
    return [
        Finding(
            "dataloader-bottleneck",
            # A bottleneck when data takes twice the compute or more; about as long as the compute is
            # only a hint (a tiny model on in-process decoding, healthy).
            "warning" if share >= _BOTTLENECK_SHARE else "info",
            message,
            {
                "dataset_class": worst["dataset_class"],
                "num_workers": worst["num_workers"],
                "batches": worst["batches"],
                "data_wait_s": round(data["wait_s"], 3),
                "loop_s": round(data["loop_s"], 3),
                "share": round(share, 3),
                "worker_startup_s": round(data.get("startup_s", 0.0), 3),
                "data_ms_per_batch": round(per_batch_ms, 2),
                "compute_ms_per_batch": round(compute_ms, 2),
            },
            fix,
        )
    ]
