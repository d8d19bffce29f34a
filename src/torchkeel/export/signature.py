"""How the trained model is called, learnt from the run's own data path, and a module that takes
those inputs as named tensors — the form every export format and server needs.

The run's loader yields batches of any shape — ``(input, target)``, a dict for
``model(**batch)``, whatever a ``loss.step_fn`` unpacks — and only the objective knows how a
batch becomes the model's call. So the export asks it: each batch goes through the run's own
``Objective`` with a forward pre-hook on the model that records the call (positional and
keyword tensors) and stops it before the forward runs. From a few such calls:

- the inputs, named: ``input`` for a lone positional tensor, ``input_0``, ``input_1``… for
  several, a dict's keys for ``model(**batch)`` or ``model(batch_dict)``; label keys are left
  out (a server has no labels);
- their dynamic axes: the batch, and every other axis whose size differed between calls (a
  padded sequence);
- the output: the tensor the model returns, or its ``logits`` (a transformers-style output), or
  the first tensor of a tuple.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchkeel.errors import ConfigError

LABEL_NAMES = ("labels", "label", "targets", "target")


class _Captured(BaseException):
    """Raised by the pre-hook to stop the forward once the call is recorded (a BaseException,
    so that a step function's ``except Exception`` does not swallow it)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args_, self.kwargs = args, kwargs


@dataclass
class Call:
    """One recorded call of the model: its positional and keyword arguments."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def capture_calls(
    model: torch.nn.Module,
    objective: Callable[..., Any],
    batches: Iterable[Any],
    limit_samples: int,
    min_calls: int = 1,
    device: torch.device | None = None,
) -> list[Call]:
    """Run ``objective(model, batch, device)`` on ``batches`` until ``limit_samples`` samples
    and ``min_calls`` batches (or the end of the data), recording how it calls ``model`` (the
    forward itself never runs).

    Raises:
        ConfigError: the objective finished without calling the model (a step function that
            calls a submodule only).
    """
    device = device or torch.device("cpu")
    calls: list[Call] = []
    samples = 0

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise _Captured(args, kwargs)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for batch in batches:
            try:
                objective(model, batch, device)
            except _Captured as captured:
                call = Call(tuple(captured.args_), dict(captured.kwargs))
            else:
                raise ConfigError(
                    "the run's loss never called the model on a batch (a loss.step_fn that calls a "
                    "submodule?); export needs model(...) to be called with the inputs"
                )
            calls.append(call)
            samples += _batch_size(call)
            if samples >= limit_samples and len(calls) >= min_calls:
                break
    finally:
        handle.remove()
    if not calls:
        raise ConfigError("the run's data gave no batch to learn the model's inputs from; check data.train / data.val")
    return calls


@dataclass
class Slot:
    """Where an input goes in the call: positional ``index``, a key of a positional dict, or a keyword."""

    name: str
    kind: str  # "arg" | "dict" | "kw"
    index: int = 0
    key: str = ""


@dataclass
class Signature:
    """The model's named tensor inputs, how they make its call, and which output is exported."""

    slots: list[Slot]
    constants: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments that are not tensors (``use_cache=False``), passed as they are."""
    num_args: int = 0
    output: str = "output"
    """``output``: the tensor returned; ``logits``: that field of a returned mapping or object."""
    ranges: dict[str, list[int]] = field(default_factory=dict)
    """The values an integer input may hold: ``[0, rows - 1]`` for one that indexes an
    ``nn.Embedding`` (token ids); a server refuses others as the client's mistake."""

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    def feed(self, call: Call) -> dict[str, torch.Tensor]:
        """The named input tensors of a recorded call."""
        feed = {}
        for slot in self.slots:
            if slot.kind == "kw":
                feed[slot.name] = call.kwargs[slot.key]
            elif slot.kind == "dict":
                feed[slot.name] = call.args[slot.index][slot.key]
            else:
                feed[slot.name] = call.args[slot.index]
        return feed

    def call(self, model: torch.nn.Module, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``model`` called with the input tensors (in ``names`` order); the exported output."""
        args: list[Any] = [None] * self.num_args
        kwargs: dict[str, Any] = dict(self.constants)
        for slot, tensor in zip(self.slots, tensors):
            if slot.kind == "kw":
                kwargs[slot.key] = tensor
            elif slot.kind == "dict":
                if args[slot.index] is None:
                    args[slot.index] = {}
                args[slot.index][slot.key] = tensor
            else:
                args[slot.index] = tensor
        return select_output(model(*args, **kwargs))


def signature_of(model: torch.nn.Module, calls: list[Call]) -> Signature:
    """The signature of the first recorded call (every call of a run has the same structure).

    Raises:
        ConfigError: an argument is neither a tensor nor a dict of tensors (a list of tensors,
            a custom object): name it and the fix.
    """
    first = calls[0]
    slots: list[Slot] = []
    args = _positional_inputs(model, first.args)
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            slots.append(Slot("input" if len(args) == 1 else f"input_{index}", "arg", index))
        elif isinstance(value, Mapping) and all(isinstance(v, torch.Tensor) for v in value.values()):
            slots += [Slot(str(key), "dict", index, str(key)) for key in value if not _is_label(str(key))]
        else:
            raise ConfigError(
                f"the model's positional argument {index} is a {type(value).__name__}; export takes "
                "tensors or dicts of tensors (return them from the dataset, or wrap the model)"
            )
    constants = {}
    for key, value in first.kwargs.items():
        if _is_label(key) or value is None:
            continue
        if isinstance(value, torch.Tensor):
            slots.append(Slot(key, "kw", key=key))
        elif isinstance(value, (bool, int, float, str)):
            constants[key] = value
        else:
            raise ConfigError(
                f"the model's keyword argument '{key}' is a {type(value).__name__}; export takes "
                "tensors (and plain numbers or flags, passed as they are)"
            )
    if "use_cache" in _parameters(model) and "use_cache" not in first.kwargs:
        constants["use_cache"] = False  # a transformers model: no key-value cache in a traced graph
    if not slots:
        raise ConfigError("the model is called without any input tensor; nothing to export")
    names = [slot.name for slot in slots]
    if len(set(names)) != len(names):
        raise ConfigError(f"the model's inputs {names} have repeated names; give the dict keys other names")
    signature = Signature(slots, constants, len(args))
    embedded: dict[int, int] = {}  # storage of a tensor an Embedding looked up → its number of rows

    def lookup(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            embedded.setdefault(args[0].untyped_storage().data_ptr(), module.num_embeddings)

    hooks = [m.register_forward_pre_hook(lookup) for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    try:
        with torch.inference_mode():
            out = model(
                *first.args,
                **{k: v for k, v in first.kwargs.items() if not _is_label(k)},
                **{k: v for k, v in constants.items() if k not in first.kwargs},
            )
    finally:
        for hook in hooks:
            hook.remove()
    for name, tensor in signature.feed(first).items():
        rows = embedded.get(tensor.untyped_storage().data_ptr()) if not tensor.is_floating_point() else None
        if rows is not None:
            signature.ranges[name] = [0, rows - 1]
    signature.output = (
        "output" if isinstance(out, torch.Tensor) else "logits" if _field(out, "logits") is not None else "output"
    )
    return signature


def dynamic_axes(signature: Signature, calls: list[Call]) -> dict[str, list[int]]:
    """Per input, the axes that vary: always the batch (0), and those whose size differed between calls."""
    feeds = [signature.feed(call) for call in calls]
    axes = {}
    for name in signature.names:
        shapes = {tuple(feed[name].shape) for feed in feeds}
        rank = feeds[0][name].dim()
        axes[name] = [0] + [d for d in range(1, rank) if len({shape[d] for shape in shapes}) > 1]
    return axes


class ExportModule(torch.nn.Module):
    """The trained model behind named positional tensor inputs and one tensor output."""

    def __init__(self, model: torch.nn.Module, signature: Signature) -> None:
        super().__init__()
        self.model, self.signature = model, signature

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.signature.call(self.model, tensors)


def select_output(out: Any) -> torch.Tensor:
    """The tensor to export: the output itself, its ``logits``, or the first tensor of a tuple.

    Raises:
        ConfigError: nothing of those is a tensor.
    """
    if isinstance(out, torch.Tensor):
        return out
    logits = _field(out, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ConfigError(
        f"the model returns a {type(out).__name__} without a tensor to export; return a tensor, "
        "a tuple whose first item is one, or an object with logits"
    )


def _field(out: Any, name: str) -> Any:
    if isinstance(out, Mapping):
        return out.get(name)
    return getattr(out, name, None)


def _is_label(key: str) -> bool:
    return key in LABEL_NAMES or key.endswith("labels")


def _positional_inputs(model: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` less a last one the model takes as its labels with a default (``loss.output``'s
    ``model(input, target)``, nanoGPT's ``forward(idx, targets=None)``): a server has no labels."""
    positional = [p for p in _parameters(model).values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if 1 < len(args) <= len(positional):
        last = positional[len(args) - 1]
        if _is_label(last.name) and last.default is not inspect.Parameter.empty:
            return args[:-1]
    return args


def _parameters(model: torch.nn.Module) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _batch_size(call: Call) -> int:
    for value in (*call.args, *call.kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
        if isinstance(value, Mapping):
            for inner in value.values():
                if isinstance(inner, torch.Tensor) and inner.dim() > 0:
                    return int(inner.shape[0])
    return 1
