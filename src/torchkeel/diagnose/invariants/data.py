"""Invariants: data (see ``diagnose.invariants``).

What every healthy run's data satisfies, whatever its fault:

- evaluation data is not training data: the rows of the model's input seen in evaluation (no
  gradients, or every model in eval mode) from a loader other than the training ones are not,
  for the most part, rows it trained on;
- labels carry information about the inputs: an input row seen again (the next epoch) comes with
  the labels it came with before, and the labels are not one class only;
- inputs carry information: the rows of a training batch are not all identical (a transform that
  zeroes the data).

Each row of the model's input (its first tensor argument) is hashed on the device by one
vectorised integer hash of its bits (at most ``_MAX_FEATURES`` values of a row, evenly spaced),
one host transfer of ``B`` integers a call. Memory is bounded by keeping only the hashes whose
low bits are zero, a mask that widens as a set fills: the same rows are kept in training and in
evaluation, so shares stay unbiased. Labels are the rows of a classification loss's targets, used
only when they are the batch's own labels (the same values as an integer tensor the loader
handed out), so that targets the loop makes (a contrastive loss's positions) are left alone.
Duplicate rows with different labels in a healthy dataset come with the same labels every epoch:
an epoch's labels are compared with the next epoch's per row, as multisets.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import dataloader

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.introspect.sites import tensors_in, user_frame, user_site, variable_name

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "data"

_MAX_FEATURES = 1024  # values of a row that are hashed (evenly spaced)
_FIRST_STEPS = 200  # training calls hashed at every step without a loader; then every _SAMPLE_EVERY-th
_SAMPLE_EVERY = 8
_MAX_HASHES = 100_000  # training row hashes kept (a set of ints: a few MiB)
_MAX_LABEL_ROWS = 50_000  # rows per epoch whose labels are kept
_LABEL_EPOCHS = 2  # a loader's first epochs whose labels are compared
_MIN_EVAL_ROWS = 32
_OVERLAP_SHARE = 0.5  # evaluation rows that are training rows: half is far beyond duplicates
_HELD_OUT_SHARE = 0.1  # a loader with fewer training rows than this is held out
_MIN_LABEL_ROWS = 50
_CHANGED_SHARE = 0.2  # rows whose labels changed from one epoch to the next (0 when labels are fixed)
_MIN_ONE_CLASS_BATCHES = 20
_POOL_ROWS = 512  # training rows (with their labels) for the nearest-neighbour test
_POOL_FEATURES = 256
_MIN_POOL_ROWS = 128
_NEIGHBOUR_Z = 2.0  # nearest neighbours agree on labels no more than chance (within 2 standard errors)
_MIN_LOSS_STEPS = 50
_LOSS_FELL = 0.75  # the loss's late median against its first steps': a run that learns falls below this
_BELOW_CHANCE = 0.95  # ... or below this share of the labels' entropy (at chance level: as invariant-loss-at-chance)
_MIN_IDENTICAL_BATCHES = 5
_IDENTICAL_SHARE = 0.9  # training batches whose rows are all the same row


@dataclass
class _Source:
    """A DataLoader as the data invariants see it."""

    name: str
    dataset_class: str
    dataset_size: int | None
    names: list[str] = field(default_factory=list)  # what the user's frames call it, innermost first
    epochs: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    eval_hashes: set[int] = field(default_factory=set)
    eval_step: int | None = None
    eval_site: dict[str, Any] | None = None
    labels: list[dict[int, list[int]]] = field(default_factory=list)  # per epoch: row hash -> [count, label sum]

    def describe(self) -> dict[str, Any]:
        return {
            "loader": self.name,
            "names": self.names,
            "dataset_class": self.dataset_class,
            "dataset_size": self.dataset_size,
        }


@dataclass
class _Pending:
    """The last training call's rows, waiting for the loss's targets."""

    hashes: list[int]
    step: int
    source: _Source | None
    rows: torch.Tensor | None  # the input itself, while the pool of rows for the neighbour test fills


_LABEL_KEYS = ("label", "labels", "target", "targets", "y")


def _input_of(batch: Any, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A batch's input: its first tensor that is not under a label's key."""
    if isinstance(batch, dict):
        tensors = [v for k, v in batch.items() if isinstance(v, torch.Tensor) and str(k).lower() not in _LABEL_KEYS]
    return next((t for t in tensors if t.dim() >= 1), None)


def _names_of(obj: Any, depth: int = 8) -> list[str]:
    """The names the user's frames bind to ``obj``, innermost first (``loader`` inside
    ``evaluate(loader)``, then ``val_loader`` where it was called)."""
    names: list[str] = []
    frame = user_frame()
    while frame is not None and depth > 0:
        name = variable_name(obj, frame)
        if name and name not in names:
            names.append(name)
        frame, depth = user_frame(frame.f_back) if frame.f_back else None, depth - 1
    return names


class Listener:
    """Hashes the rows of the model's input and pairs them with the loss's class targets."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.sources: list[_Source] = []
        self.source_of: dict[int, _Source] = {}  # id(loader) or id(iterator) -> source
        self.current: _Source | None = None
        self.batch_ints: list[torch.Tensor] = []  # the last batch's integer tensors (labels, maybe)
        self.batch_input: torch.Tensor | None = None  # the last batch's input (for models called by keyword)
        self.mask = 0  # a row hash is kept when hash & mask == 0
        self.train_hashes: dict[int, int] = {}  # row hash -> index of the source it came from (-1: none)
        self.pending: _Pending | None = None
        self.identical = {"sampled": 0, "identical": 0, "steps": [], "module": None, "shape": None, "site": None}
        self.classes = {"batches": 0, "targets": 0, "values": set(), "loader": None}
        self.pool: dict[str, Any] = {"rows": [], "labels": [], "site": None, "loader": None}
        self.coeffs: dict[tuple[int, str], torch.Tensor] = {}

    def install(self) -> None:
        patch = self.probe.patch
        patch(dataloader.DataLoader, "__iter__", self._noting_iter(dataloader.DataLoader.__iter__))
        iterator = dataloader._BaseDataLoaderIter
        patch(iterator, "__next__", self._noting_next(iterator.__next__))

    def _noting_iter(self, original: Callable) -> Callable:
        listener, probe = self, self.probe

        def __iter__(loader: Any) -> Any:
            it = original(loader)
            probe.safely(listener._note_iter, loader, it)
            return it

        return __iter__

    def _note_iter(self, loader: Any, it: Any) -> None:
        source = self.source_of.get(id(loader))
        if source is None:
            try:
                size = len(loader.dataset)
            except TypeError:
                size = None
            names = _names_of(loader)
            source = _Source(names[-1] if names else "DataLoader", type(loader.dataset).__name__, size, names)
            self.sources.append(source)
            self.source_of[id(loader)] = source
        source.epochs += 1
        self.source_of[id(it)] = source

    def _noting_next(self, original: Callable) -> Callable:
        listener, probe = self, self.probe

        def __next__(it: Any) -> Any:
            try:
                batch = original(it)
            except StopIteration:
                listener.current, listener.batch_ints, listener.batch_input = None, [], None
                raise
            listener.current = listener.source_of.get(id(it))
            probe.safely(listener._note_batch, batch)
            return batch

        return __next__

    def _note_batch(self, batch: Any) -> None:
        tensors = tensors_in(batch)
        self.batch_ints = [t for t in tensors if not t.is_floating_point() and t.dtype != torch.bool and t.dim() <= 2]
        self.batch_input = _input_of(batch, tensors)

    # ---------------------------------------------------------------- events
    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        # A model called by keyword only (``model(**batch)``): the loader's batch input stands in.
        if isinstance(module, torch.nn.modules.loss._Loss) or next(module.parameters(), None) is None:
            return  # a loss module (nn.CrossEntropyLoss()(logits, y)) is called as a model is, but reads outputs
        x = next((t for t in tensors_in(args) if t.dim() >= 1), None) if args else self.batch_input
        if x is None or x.is_complex() or x.shape[0] < 1 or x.is_meta:
            return
        evaluating = self._evaluating()
        if not evaluating and not self._sampled():
            return
        started = time.perf_counter()
        hashes = self.row_hashes(x)
        if evaluating:
            self._note_eval(hashes)
        else:
            self._note_train(module, x, hashes)
        self.probe.state.overhead_s += time.perf_counter() - started

    def _sampled(self) -> bool:
        """Every training call while its loader is in its first epochs (or the first steps without a
        loader), then every ``_SAMPLE_EVERY``-th step: the training rows are all seen by then."""
        source, step = self.current, self.probe.next_step
        early = source.epochs <= _LABEL_EPOCHS if source is not None else step <= _FIRST_STEPS
        return early or step % _SAMPLE_EVERY == 0

    def _evaluating(self) -> bool:
        models = [m for m, _ in self.probe.state.roots.values()]
        return not torch.is_grad_enabled() or bool(models and not any(m.training for m in models))

    def _note_eval(self, hashes: list[int]) -> None:
        source = self.current
        if source is None:
            return
        source.eval_rows += len(hashes)
        if source.eval_step is None:
            source.eval_step, source.eval_site = self.probe.next_step, user_site()
        if len(source.eval_hashes) < _MAX_HASHES:
            source.eval_hashes.update(h for h in hashes if not h & self.mask)

    def _note_train(self, module: torch.nn.Module, x: torch.Tensor, hashes: list[int]) -> None:
        source, probe = self.current, self.probe
        index = -1
        if source is not None:
            source.train_rows += len(hashes)
            index = self.sources.index(source)
        for h in hashes:
            if not h & self.mask:
                self.train_hashes.setdefault(h, index)
        if len(self.train_hashes) > _MAX_HASHES:
            self.mask = self.mask * 2 + 1
            self.train_hashes = {h: i for h, i in self.train_hashes.items() if not h & self.mask}
        pooling = x.is_floating_point() and len(self.pool["labels"]) < _POOL_ROWS
        self.pending = _Pending(hashes, probe.next_step, source, x if pooling else None)
        if len(hashes) >= 2:
            same = self.identical
            same["sampled"] += 1
            if len(set(hashes)) == 1:
                same["identical"] += 1
                if same["module"] is None:
                    same["module"], same["shape"] = probe.name_of(module), list(x.shape)
                    same["site"], same["max_abs"] = user_site(), float(x.detach().abs().max())
                if len(same["steps"]) < 5:
                    same["steps"].append(probe.next_step)

    def on_loss_targets(self, target: torch.Tensor) -> None:
        pending, probe = self.pending, self.probe
        if pending is None or pending.step != probe.next_step or self._evaluating():
            return
        if target.is_floating_point() or target.dim() < 1 or target.shape[0] != len(pending.hashes):
            return
        source = pending.source
        if source is None:
            return
        wanted = source.epochs <= _LABEL_EPOCHS or len(self.classes["values"]) < 2 or pending.rows is not None
        if not wanted or not self._from_batch(target) or not self._input_from_batch(pending.hashes):
            return
        self.pending = None
        self._note_classes(target, source)
        if pending.rows is not None and target.dim() == 1:
            self._pool(pending.rows, target, source)
        if source.epochs > _LABEL_EPOCHS:
            return
        while len(source.labels) < source.epochs:
            source.labels.append({})
        table = source.labels[source.epochs - 1]
        for h, label in zip(pending.hashes, self.row_hashes(target)):
            if len(table) >= _MAX_LABEL_ROWS and h not in table:
                continue
            entry = table.setdefault(h, [0, 0])
            entry[0] += 1
            entry[1] += label

    def _pool(self, x: torch.Tensor, target: torch.Tensor, source: _Source) -> None:
        """Keep rows (≤ ``_POOL_FEATURES`` evenly spaced values each) and their labels for the neighbour test."""
        pool = self.pool
        rows = x.detach().reshape(x.shape[0], -1)
        if rows.shape[1] > _POOL_FEATURES:
            picks = torch.linspace(0, rows.shape[1] - 1, _POOL_FEATURES, device=rows.device).long()
            rows = rows.index_select(1, picks)
        room = _POOL_ROWS - len(pool["labels"])
        pool["rows"].append(rows[:room].float().cpu())
        pool["labels"].extend(target[:room].tolist())
        if pool["site"] is None:
            pool["site"], pool["loader"] = user_site(), source.describe()

    def _input_from_batch(self, hashes: list[int]) -> bool:
        """Whether the model's input rows are the last batch's input rows (reshaped or moved, not
        another batch): only then are the targets its rows' labels."""
        x = self.batch_input
        return x is not None and x.shape[0] == len(hashes) and sorted(self.row_hashes(x)) == sorted(hashes)

    def _from_batch(self, target: torch.Tensor) -> bool:
        """Whether ``target`` holds the same values as an integer tensor of the last batch (in any order)."""
        flat = target.detach().flatten().cpu()
        for t in self.batch_ints:
            if t.numel() == flat.numel() and torch.equal(t.flatten().cpu().sort()[0], flat.sort()[0]):
                return True
        return False

    def _note_classes(self, target: torch.Tensor, source: _Source) -> None:
        classes = self.classes
        if len(classes["values"]) > 1:
            return
        valid = target[target >= 0]  # negative: an ignore_index
        if not valid.numel():
            return
        classes["values"].update(int(v) for v in valid.unique()[:2].tolist())
        classes["batches"] += 1
        classes["targets"] += int(valid.numel())
        classes["loader"] = classes["loader"] or source.describe()

    # ---------------------------------------------------------------- hashing
    def row_hashes(self, x: torch.Tensor) -> list[int]:
        """One integer per row of ``x`` (its first dimension): equal rows hash equal."""
        rows = x.detach().reshape(x.shape[0], -1)
        if rows.shape[1] > _MAX_FEATURES:
            picks = torch.linspace(0, rows.shape[1] - 1, _MAX_FEATURES, device=rows.device).long()
            rows = rows.index_select(1, picks)
        if rows.dtype == torch.bool:
            bits = rows.to(torch.int64)
        else:
            as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[rows.element_size()]
            bits = rows.contiguous().view(as_int).to(torch.int64)
        key = (bits.shape[1], str(bits.device))
        coeffs = self.coeffs.get(key)
        if coeffs is None:
            generator = torch.Generator().manual_seed(bits.shape[1])  # its own generator: the script's stay untouched
            coeffs = torch.randint(1, 2**62, (bits.shape[1],), generator=generator).mul_(2).add_(1).to(bits.device)
            self.coeffs[key] = coeffs
        # One host transfer of B integers (a sync; the model's input is ready by now).
        return (bits * coeffs).sum(dim=1).add_(bits.shape[1]).tolist()

    def finish(self) -> None:
        overlaps = [self._overlap(source) for source in self.sources if source.eval_rows and not source.train_rows]
        labels = [self._labels(source) for source in self.sources if len(source.labels) >= 2]
        classes = dict(self.classes, values=sorted(self.classes["values"]))
        self.probe.facts.invariants[FAMILY] = {
            "neighbours": _neighbour_agreement(self.pool),
            "overlaps": [o for o in overlaps if o is not None],
            "labels": labels,
            "classes": classes,
            "identical": self.identical,
        }

    def _overlap(self, source: _Source) -> dict[str, Any] | None:
        kept = [h for h in source.eval_hashes if not h & self.mask]
        matched = [self.train_hashes[h] for h in kept if h in self.train_hashes]
        trained_on = sorted({i for i in matched if i >= 0})
        return {
            **source.describe(),
            "eval_rows": source.eval_rows,
            "rows_compared": len(kept),
            "rows_in_training": len(matched),
            "train_loaders": [self.sources[i].describe() for i in trained_on],
            "step": source.eval_step,
            "site": source.eval_site,
        }

    def _labels(self, source: _Source) -> dict[str, Any]:
        first, second = source.labels[0], source.labels[1]
        compared = changed = 0
        for h, (count, total) in first.items():
            again = second.get(h)
            if again is not None and again[0] == count:
                compared += 1
                changed += again[1] != total
        return {**source.describe(), "rows_compared": compared, "rows_changed": changed}


def _neighbour_agreement(pool: dict[str, Any]) -> dict[str, Any] | None:
    """How often a pooled row's nearest other row (Euclidean, in input space) has its label, against
    chance (the agreement of labels drawn independently of the inputs: the sum of squared class shares)."""
    labels = torch.tensor(pool["labels"])
    if len(labels) < _MIN_POOL_ROWS:
        return None
    rows = torch.cat(pool["rows"])
    distances = torch.cdist(rows, rows)
    distances.fill_diagonal_(float("inf"))
    nearest = distances.argmin(dim=1)
    agreement = float((labels[nearest] == labels).float().mean())
    shares = torch.unique(labels, return_counts=True)[1].float() / len(labels)
    chance = float((shares**2).sum())
    entropy = float(-(shares * shares.log()).sum())
    spread = math.sqrt(max(chance * (1 - chance), 1e-12) / len(labels))
    return {
        "rows": len(labels),
        "agreement": round(agreement, 4),
        "chance": round(chance, 4),
        "entropy": round(entropy, 4),
        "z": round((agreement - chance) / spread, 2),
        "site": pool["site"],
        **(pool["loader"] or {}),
    }


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
    "invariant-identical-inputs": {"nonfinite-input"},
    "invariant-one-class": {"label-out-of-range"},
}
