"""The data family's detectors: pure functions from ``Facts`` to findings (see ``diagnose.invariants.data``)."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.diagnose.invariants.common import ANY_CAUSE

if TYPE_CHECKING:
    pass

FAMILY = "data"
_MIN_EVAL_ROWS = 32
_OVERLAP_SHARE = 0.5  # evaluation rows that are training rows: half is far beyond duplicates
_HELD_OUT_SHARE = 0.1  # a loader with fewer training rows than this is held out
_MIN_LABEL_ROWS = 50
_CHANGED_SHARE = 0.2  # rows whose labels changed from one epoch to the next (0 when labels are fixed)
_MIN_ONE_CLASS_BATCHES = 20
# Nearest neighbours agree on labels no more than chance: z under 4. Mutual nearest pairs are counted twice,
# so the binomial standard error is too small and labels drawn apart from the inputs reach z = 2 about one
# run in ten (the corpus script, unseeded); informative labels give z of 10 or more.
_NEIGHBOUR_Z = 4.0
_MIN_LOSS_STEPS = 50
_LOSS_FELL = 0.75  # the loss's late median against its first steps': a run that learns falls below this
_BELOW_CHANCE = 0.95  # ... or below this share of the labels' entropy (at chance level: as invariant-loss-at-chance)
_MIN_IDENTICAL_BATCHES = 5
_IDENTICAL_SHARE = 0.9  # training batches whose rows are all the same row


# ---------------------------------------------------------------- detectors
def identical_inputs(facts: Any, outcome: object) -> list[Finding]:
    """Every row of the model's input is the same row, batch after batch: the inputs carry nothing."""
    same = facts.invariants.get(FAMILY, {}).get("identical")
    if not same or same["sampled"] < _MIN_IDENTICAL_BATCHES or same["identical"] < _IDENTICAL_SHARE * same["sampled"]:
        return []
    site = same["site"] or {}
    message = (
        f"every row of {same['module']}'s input was the same row in {same['identical']} of {same['sampled']} "
        f"training batches (shape {same['shape']}, largest |value| {same['max_abs']:.4g}) from step {same['steps'][0]}: "
        "the inputs carry no information about the samples"
    )
    evidence = {
        "module": same["module"],
        "shape": same["shape"],
        "batches": same["sampled"],
        "identical_batches": same["identical"],
        "threshold": _IDENTICAL_SHARE,
        "max_abs": same["max_abs"],
        "steps": same["steps"],
        **site_fields(site),
    }
    fix = "look at what the dataset or its transforms return: a transform (or a normalisation by zero) wipes the input"
    return [Finding("invariant-identical-inputs", "warning", message, evidence, fix)]


def labels_change(facts: Any, outcome: object) -> list[Finding]:
    """An input row seen again the next epoch comes with other labels: the labels are drawn or shuffled apart from the inputs."""
    found = []
    for rec in facts.invariants.get(FAMILY, {}).get("labels", []):
        compared, changed = rec["rows_compared"], rec["rows_changed"]
        if compared < _MIN_LABEL_ROWS or changed < _CHANGED_SHARE * compared:
            continue
        message = (
            f"{changed} of {compared} input rows that {rec['loader']} ({rec['dataset_class']}) handed out again in its "
            f"second epoch came with other labels than in its first ({changed / compared:.0%}, a healthy dataset: 0): "
            "the labels carry no information about the inputs"
        )
        evidence = {**rec, "share": changed / compared, "threshold": _CHANGED_SHARE, "epochs": [1, 2]}
        fix = "keep each sample's label with its input: labels drawn at random or shuffled apart from the inputs teach nothing"
        found.append(Finding("invariant-labels-change", "warning", message, evidence, fix))
    return found[:1]


def labels_uninformative(facts: Any, outcome: object) -> list[Finding]:
    """A row's nearest neighbour in input space has its label no more often than chance, and the loss
    does not fall: the labels carry no information about the inputs (shuffled apart from them once)."""
    rec = facts.invariants.get(FAMILY, {}).get("neighbours")
    if not rec or rec["z"] >= _NEIGHBOUR_Z or rec["chance"] > 0.9:
        return []
    losses = [x["value"] for x in facts.losses if math.isfinite(x["value"])]
    if len(losses) < _MIN_LOSS_STEPS or len(facts.optimizers) > 1:
        return []  # too short; several optimizers: their losses do not tell whether one model learns
    first, late = statistics.median(losses[:5]), statistics.median(losses[len(losses) // 2 :])
    if late < _LOSS_FELL * first or late < _BELOW_CHANCE * rec["entropy"]:
        return []  # the model learns: raw inputs' neighbours may say little (audio, shifted images)
    message = (
        f"the labels from {rec.get('loader')} ({rec.get('dataset_class')}) carry no information about the inputs: "
        f"a training row's nearest other row has its label {rec['agreement']:.1%} of the time, what labels drawn "
        f"apart from the inputs give ({rec['chance']:.1%}; {rec['rows']} rows), and the loss stayed at "
        f"{late:.4g} from {first:.4g} (the labels' entropy: {rec['entropy']:.4g})"
    )
    evidence = {
        "loader": rec.get("loader"),
        "dataset_class": rec.get("dataset_class"),
        "rows": rec["rows"],
        "neighbour_agreement": rec["agreement"],
        "chance": rec["chance"],
        "z": rec["z"],
        "threshold_z": _NEIGHBOUR_Z,
        "loss_first": first,
        "loss_late": late,
        "label_entropy": rec["entropy"],
        **site_fields(rec.get("site") or {}),
    }
    fix = "check that labels stay paired with their inputs (a shuffle or a sort applied to one and not the other)"
    return [Finding("invariant-labels-uninformative", "warning", message, evidence, fix)]


def one_class(facts: Any, outcome: object) -> list[Finding]:
    """The batch's class labels are one class only, in every training batch."""
    classes = facts.invariants.get(FAMILY, {}).get("classes")
    if not classes or len(classes["values"]) != 1 or classes["batches"] < _MIN_ONE_CLASS_BATCHES:
        return []
    loader = classes["loader"] or {}
    message = (
        f"every class label in {classes['batches']} training batches ({classes['targets']} labels) from "
        f"{loader.get('loader')} ({loader.get('dataset_class')}) was {classes['values'][0]}: one class only, "
        "the labels carry no information"
    )
    evidence = {**loader, "value": classes["values"][0], "batches": classes["batches"], "targets": classes["targets"]}
    fix = "check how the dataset builds its labels (a filter, a wrong column, a label overwritten with a constant)"
    return [Finding("invariant-one-class", "warning", message, evidence, fix)]


def eval_overlaps_train(facts: Any, outcome: object) -> list[Finding]:
    """Rows evaluated from a loader that did not train are, for the most part, rows the model trained on."""
    found = []
    overlaps = facts.invariants.get(FAMILY, {}).get("overlaps", [])
    # Another evaluation loader that is held out: this one (a kNN monitor's bank, a training-accuracy pass
    # under another name) is more likely deliberate; a suspicion only.
    held_out = [
        r["loader"]
        for r in overlaps
        if r["rows_compared"] >= _MIN_EVAL_ROWS and r["rows_in_training"] < _HELD_OUT_SHARE * r["rows_compared"]
    ]
    for rec in overlaps:
        compared, inside = rec["rows_compared"], rec["rows_in_training"]
        if (
            compared < _MIN_EVAL_ROWS
            or inside < _OVERLAP_SHARE * compared
            or any("train" in n.lower() for n in rec["names"])
        ):
            continue  # a loader named for the training data evaluates it on purpose
        trained = rec["train_loaders"]
        names = ", ".join(f"{t['loader']} ({t['dataset_class']})" for t in trained) or "the training data"
        message = (
            f"{inside} of {compared} rows the model was evaluated on from {rec['loader']} ({rec['dataset_class']}) "
            f"are rows it trained on from {names} ({inside / compared:.0%}): the evaluation measures memory, "
            "not generalisation"
        )
        evidence = {
            "loader": rec["loader"],
            "dataset_class": rec["dataset_class"],
            "dataset_size": rec["dataset_size"],
            "train_loaders": [t["loader"] for t in trained],
            "train_datasets": [t["dataset_class"] for t in trained],
            "eval_rows": rec["eval_rows"],
            "rows_compared": compared,
            "rows_in_training": inside,
            "share": inside / compared,
            "threshold": _OVERLAP_SHARE,
            "step": rec["step"],
            "held_out_loaders": held_out,
            **site_fields(rec["site"] or {}),
        }
        fix = "evaluate on held-out data: build the evaluation loader from a split the training loader never reads"
        severity = "info" if held_out else "warning"
        found.append(Finding("invariant-eval-overlaps-train", severity, message, evidence, fix))
    return found


IDS: tuple[str, ...] = (
    "invariant-identical-inputs",
    "invariant-labels-change",
    "invariant-labels-uninformative",
    "invariant-one-class",
    "invariant-eval-overlaps-train",
)
DETECTORS: tuple = (identical_inputs, labels_change, labels_uninformative, one_class, eval_overlaps_train)
EXPLAINED_BY: dict[str, set[str]] = {
    "invariant-labels-uninformative": {ANY_CAUSE},
    "invariant-identical-inputs": {"nonfinite-input"},
    "invariant-one-class": {"label-out-of-range"},
}
