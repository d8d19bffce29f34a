"""Habits of the training loop that break training without an error: functional dropout left on
in eval mode, class labels that arrive in order, parameters frozen at their random initial values.

Called from the other listeners (the function mode hands over ``F.dropout`` calls, the loss check
hands over the targets of each classification loss); the loads of weights are seen by wrapping
``nn.Module._load_from_state_dict``, which ``load_state_dict`` calls for every submodule.
"""

from __future__ import annotations

import linecache
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchkeel.diagnose.events import BatchLabels, DropoutAlwaysOn
from torchkeel.introspect.sites import is_user_file, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe


def _noting(build: Callable, loaded: weakref.WeakSet) -> Callable:
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        module = build(cls, *args, **kwargs)
        loaded.add(module)
        return module

    return from_pretrained


def _library_model(module: torch.nn.Module) -> bool:
    """A model class of an installed library other than torch (transformers, timm): its weights
    come from its own ``from_pretrained``, which need not pass through ``load_state_dict``."""
    name = type(module).__module__ or ""
    if name.split(".")[0] in ("torch", "__main__"):
        return False
    source = getattr(sys.modules.get(name), "__file__", None)
    return bool(source) and not is_user_file(source)


def _says_training(site: dict[str, Any] | None) -> bool:
    """The call names ``training=`` on its line: dropout kept on on purpose (Monte Carlo dropout)."""
    if not site or not site.get("file"):
        return False
    return "training" in linecache.getline(site["file"], site["line"])


_LABEL_STEPS = 64  # the class targets of the first steps are kept: enough to see an order


class HabitListener:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.loaded: weakref.WeakSet = weakref.WeakSet()  # modules whose own weights came from a state dict
        self.labels: list[BatchLabels] = []

    def install(self) -> None:
        original = torch.nn.Module._load_from_state_dict
        loaded = self.loaded

        def _load_from_state_dict(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            loaded.add(module)
            return original(module, *args, **kwargs)

        self.probe.patch(torch.nn.Module, "_load_from_state_dict", _load_from_state_dict)
        for cls in (torch.nn.Embedding, torch.nn.EmbeddingBag):  # from_pretrained(vectors, freeze=True)
            self.probe.patch(cls, "from_pretrained", classmethod(_noting(cls.from_pretrained.__func__, loaded)))

    def check_dropout(self, func: Callable, args: Any, kwargs: dict) -> None:
        """``F.dropout(x, p)`` inside a module in eval mode: ``training`` defaults to True, so the
        dropout stays on when the model evaluates (``training=self.training`` was left out)."""
        probe = self.probe
        stack = probe.state.module_stack
        if not stack or stack[-1].training or probe.facts.events.get("dropout-always-on"):
            return
        names = ("input", "p", "training", "inplace")
        bound = {**dict(zip(names, args)), **kwargs}
        p, training = float(bound.get("p", 0.5)), bound.get("training", True)
        site = user_site()
        if training is True and p > 0 and not _says_training(site):
            probe.record(
                "dropout-always-on",
                DropoutAlwaysOn(
                    step=probe.next_step,
                    module=probe.name_of(stack[-1]),
                    call=f"F.{func.__name__}",
                    p=p,
                    **(site or {}),
                ),
            )

    def on_loss_targets(self, target: torch.Tensor) -> None:
        """The distinct classes of a training batch (losses computed with gradients on)."""
        probe = self.probe
        if target.is_floating_point() or not target.numel():
            return
        if len(self.labels) >= _LABEL_STEPS or not torch.is_grad_enabled() or target.dim() != 1:
            return
        if self.labels and self.labels[-1]["step"] == probe.next_step:
            return  # one loss per step is enough
        classes = torch.unique(target.detach()).tolist()
        self.labels.append(
            BatchLabels(step=probe.next_step, classes=classes[:8], num_classes=len(classes), size=int(target.numel()))
        )

    def finish(self) -> None:
        """Parameters an optimizer was given that stayed frozen (``requires_grad=False``) at their
        initial values (never loaded, never stepped: a backbone trained in a first stage and then
        frozen was trained), in modules the forward pass used."""
        probe, facts = self.probe, self.probe.facts
        facts.events["batch-labels"] = list(self.labels)
        names, owners = probe.param_names(), probe.owner_of()
        loaded = {
            id(p)
            for root, _ in probe.state.roots.values()
            for m in root.modules()
            if m in self.loaded or _library_model(m)
            for p in m.parameters()
        }
        frozen, trainable = [], 0
        for opt in probe.state.optimizers:
            for p in (p for g in opt.param_groups for p in g["params"]):
                owner = owners.get(id(p))
                if p.requires_grad:
                    trainable += 1
                elif owner is not None and id(owner) in probe.state.used and id(p) not in loaded | probe.state.trained:
                    frozen.append({"parameter": names.get(id(p), "?"), "module": probe.name_of(owner)})
        facts.frozen = {"parameters": frozen, "trainable_in_optimizers": trainable}
