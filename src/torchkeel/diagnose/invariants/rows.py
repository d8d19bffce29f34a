"""Invariants: the rows of a batch (see ``diagnose.invariants``).

The samples of a batch are independent in evaluation mode: with Dropout off and BatchNorm on its
running statistics, the output for sample i does not depend on sample j. Whatever the fault that
breaks it (a recurrent or Transformer layer without ``batch_first=True`` fed ``(batch, seq,
feature)`` recurs or attends across the batch; a ``view`` where a ``permute`` belongs scrambles
batch and time; a softmax or a normalisation over dim 0; a ``sum(dim=0)``), changing one sample
changes the others' outputs.

Checked on a model's training call (gradients on, the model training) from the ``_CHECK_STEPS``-th
step on, at most ``len(_CHECK_STEPS)`` times a model: inside the call's forward pre-hook, before the
script's own forward, the model runs three more times in eval mode under ``no_grad`` (the batch,
then the batch with its first row and with its last row replaced by another row), and the other
rows' outputs are compared. Dim 0 is the batch only when it has the row count of the batch the
DataLoader handed out (else of the training losses' targets) and no other dimension of the input
has it. The script is not disturbed: the calls are not observed (``probe.state.busy``), each starts
from the generators' states of the moment (torch's, NumPy's, Python's), which are then put back;
the modules' training flags, plain attributes (an RNN's stored hidden state) and buffers are
restored, and any exception skips the check.
"""

from __future__ import annotations

import contextlib
import io
import random
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.diagnose.invariants._rows_reach import (
    _attends,
    _later_half,
    _reach,
    _reversed,
    input_ignored,
    order_ignored,
)
from torchkeel.diagnose.invariants.common import chained
from torchkeel.introspect.sites import tensors_in, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "rows"
_CHECK_STEPS = (3, 10, 30)  # a model's k-th check is at its first training call from this step on
_MAX_CHECKS = 6  # checks a run, all models together
_MIN_ROWS = 4
_TOLERANCE = 1e-4  # a row changed: by more than this fraction of the output's largest magnitude
_MAX_BUFFER_BYTES = 1 << 28  # buffers copied before the calls (to put back what a forward changes)
_LOSSES = (
    F.cross_entropy,
    F.nll_loss,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
)
_SCALARS = (int, float, bool, str, type(None))
_WRAPPERS = ("DataParallel", "DistributedDataParallel", "FullyShardedDataParallel")


class Listener:
    """At a few training calls of each model, whether changing one sample changes the others' outputs."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.fetched = False  # a DataLoader handed out a batch since the last step
        self.targets: set[int] = set()  # row counts of this step's training losses' targets
        self.targets_before: set[int] = set()  # ... and the step's before
        self.done: dict[int, int] = {}  # model id → checks done
        self.checked_at: dict[int, int] = {}  # model id → the step of its latest check
        self.checks: list[dict[str, Any]] = []
        self.unchecked: set[int] = set()  # ids of models that cannot be checked (hooks, batch statistics)

    def install(self) -> None:
        checks = self.probe.modules.loss_checks
        for func in _LOSSES:
            checks[func] = chained(checks.get(func), self._note_targets)

    def _note_targets(self, func: Callable, args: Any, kwargs: dict) -> None:
        target = kwargs.get("target", args[1] if len(args) > 1 else None)
        if isinstance(target, torch.Tensor) and target.dim() >= 1 and torch.is_grad_enabled() and len(self.targets) < 8:
            self.targets.add(int(target.shape[0]))

    def on_fetched(self) -> None:
        self.fetched = True

    def on_step_ends(self) -> None:
        self.fetched, self.targets_before, self.targets = False, self.targets, set()

    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        probe, key = self.probe, id(module)
        done, step = self.done.get(key, 0), probe.next_step
        if probe.light or len(self.checks) >= _MAX_CHECKS or done >= len(_CHECK_STEPS) or step < _CHECK_STEPS[done]:
            return
        if not torch.is_grad_enabled() or not module.training or self.checked_at.get(key) == step:
            return
        found = self._batch_input(module, args)
        if found is None:
            return
        self.done[key], self.checked_at[key] = done + 1, step
        start, busy = time.perf_counter(), probe.state.busy
        probe.state.busy = True  # the extra calls are the probe's, not the script's
        try:
            check = _compare(module, args, *found)
        except Exception:  # noqa: BLE001 - a model that cannot run so is not checked; the script goes on
            check = None
        finally:
            probe.state.busy = busy
            probe.state.overhead_s += time.perf_counter() - start
        if check is not None:
            x = found[1]
            check.update(model=probe.name_of(module), input_shape=list(x.shape), step=step, **(user_site() or {}))
            self.checks.append(check)

    def finish(self) -> None:
        self.probe.facts.invariants[FAMILY] = {"checks": self.checks}

    def _batch_input(self, module: torch.nn.Module, args: Any) -> tuple[int, torch.Tensor] | None:
        """(position, tensor) of the call's first floating argument when its dim 0 is the batch."""
        if not isinstance(args, tuple):
            return None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return None  # extra forwards on one rank could meet collectives the others never call
        if not all(isinstance(a, (torch.Tensor, *_SCALARS)) for a in args):
            return None  # a graph, a list of images, a batch object: what a row is cannot be told
        index = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if index is None:  # token ids: (batch, time) integers
            index = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() == 2), None)
        if index is None:
            return None
        x = args[index]
        rows = int(x.shape[0]) if x.dim() >= 1 else 0
        if rows < _MIN_ROWS or x.is_sparse or x.is_meta or list(x.shape).count(rows) > 1:
            return None
        loader = self.probe.state.last_loader
        if self.fetched and loader is not None and loader.get("batch_size"):
            known = {loader["batch_size"]}  # the loader's batch: what a loss sees may be reshaped
        else:
            known = self.targets | self.targets_before
        if rows not in known:
            return None
        for other in (a for a in args if isinstance(a, torch.Tensor) and a is not x):
            if other.is_sparse or list(other.shape).count(rows) > 1:
                return None  # an adjacency: rows that relate samples to samples
            if not (other.is_floating_point() or other.dim() == 0 or other.shape[0] == rows):
                return None  # integer indices over the rows (a graph's edges)
        if id(module) in self.unchecked or not _checkable(module):
            self.unchecked.add(id(module))
            return None
        return index, x


def _checkable(module: torch.nn.Module) -> bool:
    """A model with parameters, no hooks of the script's own, no batch statistics in eval mode."""
    if isinstance(module, torch.nn.modules.loss._Loss) or type(module).__name__ in _WRAPPERS:
        return False
    if next(module.parameters(), None) is None:
        return False
    for m in module.modules():
        hooks = (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
        if any(not getattr(h, "__module__", "").startswith("torch.") for h in hooks):
            return False  # a hook of the script's own would run on the extra calls
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is None:
            return False  # batch statistics in eval mode too: mixing on purpose
    return True


def _compare(module: torch.nn.Module, args: tuple, index: int, x: torch.Tensor) -> dict[str, Any] | None:
    """The model's eval-mode outputs on the batch and on the batch with one row replaced."""
    rows = int(x.shape[0])
    kept = _Kept(module)
    if kept.too_large:
        return None
    variants = [(None, x)] + [(k, _replaced(x, k)) for k in (0, rows - 1)] + [("reach", _later_half(x))]
    variants.append(("order", _reversed(x) if _attends(module) else None))
    outputs = []
    try:
        with torch.no_grad(), _quiet():
            module.eval()
            for k, xk in variants:
                if xk is None:
                    continue
                with _generators_kept(x.device):
                    out = module(*args[:index], xk, *args[index + 1 :])
                outputs.append((k, _rows_of(out, rows)))
                if not kept.restore():
                    return None  # the forward changed parameters: no more calls
    finally:
        kept.restore_flags()
    base = outputs[0][1]
    if base is None or not bool(torch.isfinite(base).all()):
        return None
    scale = float(base.abs().max())
    if scale == 0:
        return None
    tolerance = max(_TOLERANCE, 8 * torch.finfo(base.dtype).eps)  # float16/bfloat16 round coarser
    base = base.float()
    worst: dict[str, Any] | None = None
    reach = order = None
    for k, out in outputs[1:]:
        if out is None or out.shape != base.shape:
            return None
        change = (out.float() - base).abs().reshape(rows, -1).amax(dim=1) / scale
        if k in ("reach", "order"):
            found_k = _reach(k, x, out.float(), base, scale, tolerance)
            reach, order = (found_k, order) if k == "reach" else (reach, found_k)
            continue
        change[k] = 0.0
        changed = int((change > tolerance).sum())
        if worst is None or changed > worst["rows_changed"]:
            worst = {"changed_row": k, "rows_changed": changed, "max_relative_change": float(change.max())}
    worst = worst or {"changed_row": None, "rows_changed": 0, "max_relative_change": 0.0}
    found = {**worst, "rows_compared": rows - 1, "output_shape": list(base.shape), "tolerance": tolerance}
    return {**found, "reach": reach, "order": order}


def _replaced(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """``x`` with row ``k`` replaced by another row that differs from it (None: all rows equal)."""
    rows = x.shape[0]
    for j in (rows // 2, 1, rows - 2):
        if j != k and not torch.equal(x[j], x[k]):
            changed = x.detach().clone()
            changed[k] = x[j]
            return changed
    return None


def _rows_of(out: Any, rows: int) -> torch.Tensor | None:
    """The output's first floating tensor with ``rows`` rows (a (rows, rows) similarity: None)."""
    for t in tensors_in(out):
        if t.is_floating_point() and t.dim() >= 1 and t.shape[0] == rows:
            return None if list(t.shape).count(rows) > 1 else t.detach()
    return None


@contextlib.contextmanager
def _generators_kept(device: torch.device) -> Iterator[None]:
    """Run from the generators' current states and put them back (torch's, NumPy's, Python's)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    devices, device_type = [], "cuda"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = list(range(torch.cuda.device_count()))
    elif device.type != "cpu":
        devices, device_type = [device.index or 0], device.type
    try:
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The extra calls print and warn nothing (the script's output stays its own)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _plain(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, *_SCALARS)):
        return True
    return isinstance(value, tuple) and all(isinstance(v, (torch.Tensor, *_SCALARS)) for v in value)


class _Kept:
    """A model's state that its forward may change: training flags, plain attributes, buffers,
    and the parameters' version counters (an in-place change cannot be undone: it stops the check)."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.modules = list(root.modules())
        self.flags = [m.training for m in self.modules]
        self.plain = [{k: v for k, v in vars(m).items() if k != "training" and _plain(v)} for m in self.modules]
        self.buffers = [dict(m._buffers) for m in self.modules]
        kept = [b for bs in self.buffers for b in bs.values() if b is not None]
        self.too_large = sum(b.numel() * b.element_size() for b in kept) > _MAX_BUFFER_BYTES
        self.copies = {} if self.too_large else {id(b): (b._version, b.clone()) for b in kept}
        self.versions = [(p, p._version) for p in root.parameters()]

    def restore(self) -> bool:
        """Put back attributes and buffers; False when a parameter was changed in place."""
        for m, plain, buffers in zip(self.modules, self.plain, self.buffers):
            own = vars(m)
            for k in [k for k, v in own.items() if k not in plain and k != "training" and _plain(v)]:
                del own[k]
            own.update({k: v for k, v in plain.items() if own.get(k) is not v})
            for name, b in buffers.items():
                m._buffers[name] = b
                if b is not None and b._version != self.copies[id(b)][0]:
                    b.copy_(self.copies[id(b)][1])
                    self.copies[id(b)] = (b._version, self.copies[id(b)][1])
            for name in [n for n in m._buffers if n not in buffers]:
                del m._buffers[name]
        return all(p._version == version for p, version in self.versions)

    def restore_flags(self) -> None:
        for m, flag in zip(self.modules, self.flags):
            m.training = flag


def rows_mixed(facts: Any, outcome: object) -> list[Finding]:
    checks = facts.invariants.get(FAMILY, {}).get("checks", [])
    by_model: dict[str, list[dict[str, Any]]] = {}
    for check in checks:
        by_model.setdefault(check["model"], []).append(check)
    for model, done in by_model.items():
        mixed = [c for c in done if c["rows_changed"] > 0]
        if not mixed or 2 * len(mixed) < len(done):
            continue
        first = mixed[0]
        message = (
            f"in evaluation mode the samples of {model}'s batch are not independent: changing sample "
            f"{first['changed_row']} of its input (shape {first['input_shape']}) changed the outputs of "
            f"{first['rows_changed']} other samples (max relative change {first['max_relative_change']:.3g}) at step "
            f"{first['step']}: the model mixes the rows of the batch (a layer that reads dim 0 as time or "
            "features, a view that scrambles batch and other dimensions, a softmax or sum over dim 0)"
        )
        evidence = {
            "model": model,
            "input_shape": first["input_shape"],
            "output_shape": first["output_shape"],
            "changed_row": first["changed_row"],
            "rows_changed": first["rows_changed"],
            "rows_compared": first["rows_compared"],
            "max_relative_change": first["max_relative_change"],
            "tolerance": first["tolerance"],
            "checks": len(done),
            "checks_mixed": len(mixed),
            "step": first["step"],
            **site_fields(first),
        }
        fix = (
            "batch_first=True on recurrent/transformer layers fed (batch, seq, feature); permute, not view, to "
            "reorder dims; normalise over the feature dim"
        )
        return [Finding("invariant-rows-mixed", "warning", message, evidence, fix)]
    return []


IDS: tuple[str, ...] = ("invariant-rows-mixed", "invariant-input-ignored", "invariant-order-ignored")
DETECTORS: tuple = (rows_mixed, input_ignored, order_ignored)
EXPLAINED_BY: dict[str, set[str]] = {"invariant-rows-mixed": {"softmax-over-batch"}}
