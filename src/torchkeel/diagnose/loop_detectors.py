"""Detectors for a loop whose calls are in the wrong order or at the wrong cadence: gradients
cleared between backward and step, clipped before they exist, a scheduler stepped before its
optimizer or once a batch on an epoch horizon, micro-batches summed without dividing the loss, a
model left in eval mode for training. Pure functions of ``Facts``, as in ``detectors``."""

from __future__ import annotations

from torchkeel.diagnose.events import (
    AugmentationInEvaluation,
    ClipBeforeBackward,
    GeneratorInWorkers,
    InputScale,
    SoftmaxOverBatch,
    TrainedInEval,
    ZeroGradBeforeStep,
)
from torchkeel.diagnose.findings import Finding, site_fields, where_text
from torchkeel.diagnose.probe import Facts
from torchkeel.diagnose.runner import ScriptOutcome

# Schedules that decay over a horizon the script sets; stepped once a batch on a horizon meant in
# epochs, they reach their end within the first epoch. Warmups (LinearLR, ConstantLR), OneCycleLR
# and transformers' LambdaLR schedules are counted in steps by design and are left out.
_DECAYS = {"StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "PolynomialLR", "MultiplicativeLR"}
_COLLAPSED = 1e-2  # the lr fell to this fraction of the one the script set within one epoch
_MIN_BATCHES = 20


def zero_grad_before_step(f: Facts, o: ScriptOutcome) -> list[Finding]:
    events = f.events.get("zero-grad-before-step", [])
    if not events or (len(events) < 2 and f.steps > 1):
        return []
    e: ZeroGradBeforeStep = events[0]
    message = (
        f"zero_grad(){where_text(e)} runs after backward() ({e['backward_at']}) and before "
        f"{e['optimizer']}.step() ({e['step_at']}): it clears the gradients the step was to use, so "
        f"step() sees none and the weights do not learn (from step {e['step']})"
    )
    evidence = {
        "step": e["step"],
        "optimizer": e["optimizer"],
        "backward_at": e["backward_at"],
        "step_at": e["step_at"],
        **site_fields(e),
    }
    fix = "Call zero_grad() before backward() (or right after step()), never between backward() and step()."
    return [Finding("zero-grad-before-step", "error", message, evidence, fix)]


def clip_before_backward(f: Facts, o: ScriptOutcome) -> list[Finding]:
    events = f.events.get("clip-before-backward", [])
    if len(events) < 2:
        return []  # once could be a clip of a first step's leftover; the fault repeats every step
    e: ClipBeforeBackward = events[0]
    message = (
        f"{e['call']}(){where_text(e)} runs before backward() ({e['backward_at']}) at every step: it clips the "
        "previous step's gradients (or none, after zero_grad), and the gradients step() uses are never clipped"
    )
    evidence = {"step": e["step"], "call": e["call"], "backward_at": e["backward_at"], "step_at": e["step_at"]}
    fix = f"Move {e['call']}() between backward() and optimizer.step()."
    return [Finding("clip-before-backward", "error", message, {**evidence, **site_fields(e)}, fix)]


def scheduler_cadence(f: Facts, o: ScriptOutcome) -> list[Finding]:
    out = []
    for e in f.events.get("scheduler-calls", []):
        per_epoch = e.get("batches_per_epoch") or 0
        lr_set, low = e["lr_set"], e["lr_first_epoch_min"]
        if (
            e["scheduler"] in _DECAYS
            and per_epoch >= _MIN_BATCHES
            and e["first_epoch_calls"] >= per_epoch // 2
            and lr_set > 0
            and low <= _COLLAPSED * lr_set
        ):
            horizon = ", ".join(f"{k}={v}" for k, v in e["horizon"].items() if k != "gamma") or "its horizon"
            message = (
                f"{e['scheduler']}.step(){where_text(e)} runs once per batch ({e['first_epoch_calls']} times in the "
                f"first epoch of {per_epoch} batches), but {horizon} reads as epochs: the learning rate fell from "
                f"{lr_set:g} to {low:.3g} within the first epoch"
            )
            evidence = {
                "scheduler": e["scheduler"],
                "horizon": e["horizon"],
                "calls": e["calls"],
                "first_epoch_calls": e["first_epoch_calls"],
                "batches_per_epoch": per_epoch,
                "lr_set": lr_set,
                "lr_first_epoch_min": low,
                "lr_reached": e["lr_reached"],
                **site_fields(e),
            }
            fix = (
                "Call scheduler.step() once per epoch (after the epoch's batches), or give the horizon in "
                "steps (step_size × batches per epoch)."
            )
            out.append(Finding("scheduler-cadence", "error", message, evidence, fix))
    return out


def scheduler_before_optimizer(f: Facts, o: ScriptOutcome) -> list[Finding]:
    early = [e for e in f.events.get("scheduler-calls", []) if e["calls_before_step"]]
    if not early or not f.steps:
        return []
    e = early[0]
    message = (
        f"{e['scheduler']}.step(){where_text(e)} runs before optimizer.step() ({e['calls_before_step']} time(s)): "
        "the schedule's first value is skipped and every later one comes a step early"
    )
    evidence = {"scheduler": e["scheduler"], "calls_before_step": e["calls_before_step"], **site_fields(e)}
    fix = "Call optimizer.step() first, then scheduler.step()."
    return [Finding("scheduler-before-optimizer", "warning", message, evidence, fix)]


def accumulation_not_averaged(f: Facts, o: ScriptOutcome) -> list[Finding]:
    groups = f.events.get("step-groups", [])[:-1] or f.events.get("step-groups", [])  # the last may be partial
    if len(groups) < 3:
        return []
    sizes = {g["backwards"] for g in groups}
    if len(sizes) != 1 or (k := sizes.pop()) < 2:
        return []
    one_per_backward = all(g["batches"] == k or (g["batches"] == 0 and g["calls"] == k) for g in groups)
    if not one_per_backward or not all(g["unscaled"] for g in groups):
        return []  # several losses of one batch (a GAN, a multitask head), or each divided before its backward
    lrs = [lr for opt in f.optimizers for lr in opt["lrs"]][:3]
    lr_text = ", ".join(f"{lr:g}" for lr in lrs)
    message = (
        f"the script accumulates {k} micro-batches per optimizer step ({k} backward() calls at {groups[0]['backward_at']}, "
        f"one per batch) without dividing the loss by {k}: the gradient is the sum of {k} batches' gradients, "
        f"so the step is {k}x what the learning rate ({lr_text}) says"
    )
    evidence = {"micro_batches": k, "steps_checked": len(groups), "backward_at": groups[0]["backward_at"], "lrs": lrs}
    fix = f"Divide each micro-batch's loss by {k} before backward() (loss = loss / {k})."
    return [Finding("accumulation-not-averaged", "warning", message, evidence, fix)]


def train_mode_not_restored(f: Facts, o: ScriptOutcome) -> list[Finding]:
    e: TrainedInEval | None = f.first(TrainedInEval)
    if e is None:
        return []
    if e["trained_until"] is not None:
        before = f"it trained in train mode until step {e['trained_until']}, then eval(){where_text(e)} was not undone"
    elif e.get("by_library"):
        before = (
            f"a library put it in eval mode{where_text(e)} (transformers' from_pretrained returns models in eval "
            "mode) and the script never calls train()"
        )
    else:
        before = f"an evaluation switched it with eval(){where_text(e)} (under no_grad) and nothing switched it back"
    message = (
        f"{e['module']} trained in eval mode for {e['steps']} step(s) from step {e['step']}: {before}, so its "
        f"{', '.join(e['layers'][:4])} train as in evaluation (no dropout, frozen batch statistics)"
    )
    evidence = {
        "module": e["module"],
        "step": e["step"],
        "steps": e["steps"],
        "trained_until": e["trained_until"],
        "layers": e["layers"],
        "by_library": bool(e.get("by_library")),
        **site_fields(e),
    }
    fix = f"Call {e['module']}.train() before training (and again after each validation pass)."
    return [Finding("train-mode-not-restored", "error", message, evidence, fix)]


def softmax_over_batch(f: Facts, o: ScriptOutcome) -> list[Finding]:
    e: SoftmaxOverBatch | None = f.first(SoftmaxOverBatch)
    if e is None:
        return []
    rows, classes = e["shape"]
    message = (
        f"{e['call']}(dim={e['dim']}){where_text(e)} normalizes a ({rows}, {classes}) output over its first axis, "
        f"the {rows} samples of the batch: each sample's probabilities depend on the others, and the "
        f"{classes} classes of one sample do not sum to 1"
    )
    evidence = {"call": e["call"], "dim": e["dim"], "shape": e["shape"], "module": e.get("module"), **site_fields(e)}
    fix = f"Use dim=1 (or dim=-1), the classes' axis: {e['call']}(x, dim=1)."
    return [Finding("softmax-over-batch", "error", message, evidence, fix)]


def input_scale(f: Facts, o: ScriptOutcome) -> list[Finding]:
    e: InputScale | None = f.first(InputScale)
    if e is None:
        return []
    if e["images"]:
        what = f"images with integer values {e['min']:g}..{e['max']:g} (not divided by 255)"
        fix = "Scale images to [0, 1] (x / 255, or ToTensor / ConvertImageDtype) and normalize them."
    else:
        columns = ", ".join(str(c) for c in e["columns"][:6])
        what = (
            f"features from {e['min']:.4g} to {e['max']:.4g}, column(s) {columns} of magnitude up to "
            f"{e['column_rms_max']:.4g} (root mean square over the batch)"
        )
        fix = "Standardize the feature columns ((x - mean) / std, computed on the training data)."
    message = (
        f"the first layer {e['module']} ({e['layer']}) receives {what}: inputs far from unit scale make the "
        "first gradients huge and training slow or unstable"
    )
    keys = ("module", "layer", "min", "max", "images", "column_rms_max", "columns", "step")
    return [Finding("input-scale", "warning", message, {k: e[k] for k in keys} | site_fields(e), fix)]


def augmentation_in_evaluation(f: Facts, o: ScriptOutcome) -> list[Finding]:
    e: AugmentationInEvaluation | None = f.first(AugmentationInEvaluation)
    if e is None:
        return []
    message = (
        f"the evaluation loader{where_text(e)} reads {e['dataset_class']} with random transforms: sample 0 differs "
        "from one read to the next, so the validation score is of augmented data and changes from run to run"
    )
    fix = "Give the validation dataset its own deterministic transform (resize, center crop, normalize)."
    return [Finding("augmentation-in-evaluation", "warning", message, {**e}, fix)]


def generator_in_workers(f: Facts, o: ScriptOutcome) -> list[Finding]:
    e: GeneratorInWorkers | None = f.first(GeneratorInWorkers)
    if e is None:
        return []
    message = (
        f"{e['dataset_class']} holds its own random generator ({', '.join(e['generators'])}) and "
        f"{e['num_workers']} DataLoader workers read it{where_text(e)}: each worker gets a copy of the same "
        "state, so the workers draw the same numbers and the augmentation repeats across them"
    )
    fix = (
        "Draw from the global generators (the DataLoader seeds torch, random and numpy in each worker), or "
        "reseed the dataset's generator in a worker_init_fn from torch.utils.data.get_worker_info().seed."
    )
    return [Finding("generator-in-workers", "warning", message, {**e}, fix)]


LOOP_DETECTORS = (
    zero_grad_before_step,
    clip_before_backward,
    scheduler_cadence,
    scheduler_before_optimizer,
    accumulation_not_averaged,
    train_mode_not_restored,
    softmax_over_batch,
    input_scale,
    augmentation_in_evaluation,
    generator_in_workers,
)
