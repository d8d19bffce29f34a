"""Values on the wrong axis or at the wrong scale: a softmax over the batch dimension of a
``(batch, classes)`` output, and inputs far from unit scale reaching the first layer (images of
0–255 as floats, feature columns of scale ≫ 1).

Fed by the module listener: the function mode hands over the softmax calls, the forward
pre-hook the first Linear, Conv or recurrent layer of a model call with its input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchkeel.diagnose.events import InputScale, SoftmaxOverBatch
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

# An RNN reads (batch, time, features) rows of pixels or readings as directly as a Linear layer.
_FIRST_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.RNNBase)
_FAR = 20.0  # an input whose largest magnitude passes this is far from unit scale
_COLUMN_SCALE = 100.0  # a feature column this large (its root mean square over the batch)
_SCALE_STEPS = 3  # the first steps' model calls are looked at


class ScaleListener:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.batch_rows: int | None = None  # rows of the current model call's first input
        self.loss_rows: set[int] = set()  # the batch sizes classification losses were given (their targets)
        self.candidates: dict[int, dict[str, Any]] = {}  # rows → a softmax over dim 0 of that many rows

    def softmaxes(self) -> dict[Callable, Callable]:
        functions = (
            torch.nn.functional.softmax,
            torch.nn.functional.log_softmax,
            torch.softmax,
            torch.log_softmax,
            torch.Tensor.softmax,
            torch.Tensor.log_softmax,
        )
        return dict.fromkeys(functions, self.check_softmax)

    def on_model_called(self, module: torch.nn.Module, args: Any) -> None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.batch_rows = int(first.shape[0]) if first is not None and first.dim() >= 1 else None
        self.probe.state.first_layer_seen = False

    def on_loss_targets(self, target: torch.Tensor) -> None:
        if target.dim() >= 1:
            self.loss_rows.add(int(target.shape[0]))

    def check_softmax(self, func: Callable, args: Any, kwargs: dict) -> None:
        probe = self.probe
        if probe.facts.events.get("softmax-over-batch"):
            return
        bound = {**dict(zip(("input", "dim"), args)), **kwargs}
        x, dim = bound.get("input"), bound.get("dim")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or dim not in (0, -2):
            return
        rows, classes = x.shape
        if rows > 1 and classes > 1 and rows == self.batch_rows and rows != classes and rows not in self.candidates:
            self.candidates[int(rows)] = SoftmaxOverBatch(
                step=probe.next_step,
                call=getattr(func, "__name__", str(func)),
                shape=[int(rows), int(classes)],
                dim=int(dim),
                module=probe.name_of(probe.state.module_stack[-1]) if probe.state.module_stack else None,
                **(user_site() or {}),
            )

    def finish(self) -> None:
        """A softmax over dim 0 is over the batch when a loss's targets had that many rows too (a
        ``(time, batch)`` attention over dim 0 is over time: its loss has batch-many targets)."""
        for rows, event in self.candidates.items():
            if rows in self.loss_rows:
                self.probe.record("softmax-over-batch", event)
                return

    def on_leaf_forward(self, module: torch.nn.Module, args: Any) -> None:
        """The model call's first Linear/Conv/RNN layer: its input, when it is data far from unit scale."""
        probe = self.probe
        if probe.state.first_layer_seen or next(module.parameters(recurse=False), None) is None:
            return
        probe.state.first_layer_seen = True
        if not isinstance(module, _FIRST_LAYERS) or probe.next_step > _SCALE_STEPS:
            return
        if probe.facts.events.get("input-scale") or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0].detach()
        if not x.is_floating_point() or args[0].grad_fn is not None or not x.numel():
            return
        largest = float(x.abs().max())
        if not largest > _FAR or not torch.isfinite(x).all():
            return
        images = x.dim() >= 3 and float(x.min()) >= 0 and largest <= 255 and bool((x == x.round()).all())
        # the features are the last axis of a Linear's or an RNN's input (a Conv's is a spatial one)
        columns = x.reshape(-1, x.shape[-1]) if x.dim() == 2 or isinstance(module, torch.nn.RNNBase) else None
        sizes = columns.double().pow(2).mean(dim=0).sqrt() if columns is not None else None  # each column's RMS
        spread = float(sizes.max()) if sizes is not None else 0.0
        if not images and spread < _COLUMN_SCALE:
            return
        wide = [int(i) for i in torch.nonzero(sizes >= _COLUMN_SCALE).flatten()[:8]] if sizes is not None else []
        probe.record(
            "input-scale",
            InputScale(
                step=probe.next_step,
                module=probe.name_of(module),
                layer=type(module).__name__,
                min=float(x.min()),
                max=float(x.max()),
                images=images,
                column_rms_max=spread,
                columns=wide,
                **(user_site() or {}),
            ),
        )
