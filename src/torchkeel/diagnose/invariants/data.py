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

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import dataloader

from torchkeel.diagnose.invariants._data_findings import (  # noqa: F401 - the family's parts, in one place
    DETECTORS,
    EXPLAINED_BY,
    FAMILY,
    IDS,
    eval_overlaps_train,
    identical_inputs,
    labels_change,
    labels_uninformative,
    one_class,
)
from torchkeel.diagnose.invariants._neighbours import _neighbour_agreement
from torchkeel.introspect.sites import tensors_in, user_frame, user_site, variable_name

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe


_MAX_FEATURES = 1024  # values of a row that are hashed (evenly spaced)
_FIRST_STEPS = 200  # training calls hashed at every step without a loader; then every _SAMPLE_EVERY-th
_SAMPLE_EVERY = 8
_MAX_HASHES = 100_000  # training row hashes kept (a set of ints: a few MiB)
_MAX_LABEL_ROWS = 50_000  # rows per epoch whose labels are kept
_LABEL_EPOCHS = 2  # a loader's first epochs whose labels are compared
_POOL_ROWS = 512  # training rows (with their labels) for the nearest-neighbour test
_POOL_FEATURES = 256


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
