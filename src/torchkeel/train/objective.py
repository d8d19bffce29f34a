"""How a batch becomes a loss, and what it weighs in accumulation.

The default is ``loss_fn(model(input), target)``, a mean over the batch's samples; a dict batch
(what a tokenized transformers dataset gives) is ``model(**batch)`` and the ``loss`` it returns.
A model that computes its own loss names it with ``output`` (``loss.output``: an index into the
tuple it returns, or a key); an ``(input, target)`` batch then runs as ``model(input, target)``
(nanoGPT's ``forward(idx, targets)``). ``logits`` (``loss.logits``) names its predictions, which
the configured metrics score (``torchkeel.train.outputs`` finds both, and names a mismatch).

A step function ``(model, batch) -> ...`` covers the rest (several inputs, contrastive losses)
and returns a scalar ``loss`` (a mean), ``(loss, {name: value})``, or a ``StepOutput``: with
``count``, a sum over ``count`` elements. Any other tuple is refused: ``(loss_sum, count)`` and
``(loss, logits)`` look alike, and guessing trains the wrong thing.

Accumulation weighs each micro-batch by its count — samples, the batch's ``count_key`` (its
labels other than ``ignore_index``, or a count to sum), or the count the step function returned
— so ``batch 16 × accumulate 4`` equals ``batch 64 × 1`` even when the loss is a mean over a
number of tokens that varies.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from torchkeel.batch import map_tensors, num_samples, take, to_device
from torchkeel.errors import ConfigError, DataError, KeelError, first_line
from torchkeel.train.outputs import Where, as_scalar, default_logits, describe, is_scalar, pick, pick_loss, suggest


@dataclass
class LossOutput:
    loss: torch.Tensor
    """A mean over ``count`` elements, or their sum when ``is_sum``."""
    is_sum: bool = False
    count: torch.Tensor | float | None = None
    """Elements a summed loss is over (``None`` for a mean: the weight was known up front)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    outputs: Any = None
    targets: Any = None


@dataclass
class StepOutput:
    """What a step function returns when a bare loss is not enough.

    ``loss`` is a mean, or a sum over ``count`` elements when ``count`` is given (accumulation
    then weighs each micro-batch by its count). ``metrics`` are logged like the loss. ``state``
    is what the next batch's call receives (an RNN's hidden state, carried across batches).
    ``logits`` are the predictions the configured metrics score, with ``targets`` their labels.
    """

    loss: torch.Tensor
    count: torch.Tensor | float | None = None
    metrics: dict[str, Any] | None = None
    state: Any = None
    logits: Any = None
    targets: Any = None


class LabelOutOfRange(DataError):
    """A class-index target is outside ``[0, num_classes)``."""

    def __init__(self, value: int, num_classes: int, sample: int) -> None:
        self.value, self.num_classes, self.sample, self.micro_batch = value, num_classes, sample, 0
        super().__init__(
            f"target {value} is outside [0, {num_classes}): the model outputs {num_classes} classes; fix the "
            "label or the model's number of outputs"
        )

    def __str__(self) -> str:
        return f"{super().__str__()} (sample {self.sample} of micro-batch {self.micro_batch})"


class Objective:
    """Computes one micro-batch's loss and its weight. ``loss_fn`` or ``step_fn``, not both.

    Args:
        loss_fn: ``loss(output, target)``, a mean over samples.
        step_fn: ``(model, batch) -> loss | (loss, metrics) | StepOutput``.
        count_key: a batch key that counts the elements the loss is a mean over; weights
            micro-batches by it instead of by samples. A label key (``labels``, ``*labels``)
            counts its elements other than ``ignore_index`` (after dropping each row's first
            label with ``shift_labels``, as a next-token loss does); any other key is summed.
        token_loss: the loss is a per-token negative log-likelihood (a language model's):
            validation logs ``val_perplexity``.
        output: where the loss is in what the model returns (an index, a key or an attribute):
            the model computes it, called as ``model(input, target)`` or ``model(**batch)``.
        logits: where the predictions are in what the model returns, for the metrics (and for
            ``loss_fn`` without ``output``); ``None``: ``logits`` of a dict or transformers output.

    Raises (when called):
        ConfigError: what the model or ``step_fn`` returned does not fit; names the key to set.
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        step_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
        count_key: str | None = None,
        ignore_index: int = -100,
        shift_labels: bool = False,
        token_loss: bool = False,
        output: Where | None = None,
        logits: Where | None = None,
    ) -> None:
        if (loss_fn is None) == (step_fn is None):
            raise ValueError("Objective needs exactly one of loss_fn and step_fn")
        if step_fn is not None and (output is not None or logits is not None):
            raise ValueError("output and logits name parts of the model's return; a step_fn returns a StepOutput")
        self.loss_fn, self.step_fn, self.count_key = loss_fn, step_fn, count_key
        self.ignore_index, self.shift_labels = ignore_index, shift_labels
        self.output, self.logits = output, logits
        self.token_loss = token_loss or shift_labels
        """The loss is a mean negative log-likelihood per token (a causal or masked LM): validation
        logs its perplexity."""
        self._last: Any = None  # the last batch run: its first row stands in for an empty one

    @classmethod
    def of(cls, loss: "Objective | Callable[[Any, Any], torch.Tensor]") -> "Objective":
        return loss if isinstance(loss, Objective) else cls(loss)

    def weight(self, batch: Any) -> float:
        """The micro-batch's weight, known before its forward: samples, or ``batch[count_key]``."""
        if self.count_key is None:
            return float(num_samples(batch))
        if not isinstance(batch, Mapping) or self.count_key not in batch:
            keys = ", ".join(map(str, batch)) if isinstance(batch, Mapping) else type(batch).__name__
            raise DataError(
                f"loss.count_key={self.count_key!r} is not a key of the batch ({keys}); "
                "name the batch key that counts the loss's elements"
            )
        count = batch[self.count_key]
        if not isinstance(count, torch.Tensor):
            return float(count)
        if is_label_key(self.count_key):
            labels = count[..., 1:] if self.shift_labels and count.dim() > 1 else count
            return float((labels != self.ignore_index).sum())  # CPU: no device sync
        return float(count.sum())

    def __call__(
        self, model: torch.nn.Module, batch: Any, device: torch.device, non_blocking: bool = False
    ) -> LossOutput:
        """Forward one micro-batch (still on the CPU as the loader gave it) and compute its loss.

        An empty batch (a rank whose share ran out, kept in step with the others) runs the model on
        stand-in rows and returns their loss times zero: every rank takes part in the same
        collectives, and a model that cannot take a batch of no rows (a transformers attention
        reshapes with ``-1``) is never given one."""
        if not num_samples(batch):
            return self._stand_in(model, batch, device, non_blocking)
        self._last = batch
        if self.step_fn is not None:
            return step_output(self.step_fn(model, to_device(batch, device, non_blocking)))
        if not isinstance(batch, (tuple, list)) and isinstance(batch, Mapping):
            batch = to_device(batch, device, non_blocking)
            out = self._model_loss(model(**batch), batch)
            return _next_token_pairs(out) if self.shift_labels else out
        inputs, targets = batch
        if self.output is not None:  # the model computes its loss: nanoGPT's forward(idx, targets)
            inputs = to_device(inputs, device, non_blocking)
            targets_on_device = to_device(targets, device, non_blocking)
            return self._model_loss(model(inputs, targets_on_device), targets_on_device)
        outputs = model(to_device(inputs, device, non_blocking))
        if self.logits is not None:
            outputs = pick(outputs, self.logits, "loss.logits")
        targets_on_device = to_device(targets, device, non_blocking)
        try:
            loss = self._loss(outputs, targets, targets_on_device, device)
        except KeelError:
            raise
        except Exception as exc:  # a loss given a tuple or dict: name the keys that pick from it
            if isinstance(outputs, torch.Tensor):
                raise
            raise ConfigError(_not_a_prediction(outputs, exc)) from exc
        if not is_scalar(loss):
            raise ConfigError(
                f"loss.target returned {describe(loss)}; it must return the batch's mean loss, one number "
                "(reduction='mean'), or set loss.step_fn"
            )
        return LossOutput(as_scalar(loss), outputs=outputs, targets=targets_on_device)

    def _loss(self, outputs: Any, targets: Any, targets_on_device: Any, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":  # on an accelerator a bad label is a device-side assert that kills the context
            check_labels(outputs, targets, self.loss_fn)
            return self.loss_fn(outputs, targets_on_device)
        try:  # an out-of-range label raises here on the CPU: name it then, free otherwise
            return self.loss_fn(outputs, targets_on_device)
        except (IndexError, RuntimeError):
            check_labels(outputs, targets, self.loss_fn)
            raise

    def _model_loss(self, out: Any, batch_or_targets: Any) -> LossOutput:
        """The loss the model returned (at ``output``; a dict batch's default: its ``loss``) and its
        predictions (at ``logits``), paired with the labels."""
        is_dict_batch = isinstance(batch_or_targets, Mapping)
        call = "model(**batch)" if is_dict_batch else "model(inputs, targets)"
        if self.output is None and is_scalar(_attribute_or_key(out, "loss")):
            loss = _attribute_or_key(out, "loss")
        elif self.output is None:
            raise ConfigError(
                f"a dict batch ({', '.join(map(str, batch_or_targets))}) runs as model(**batch), and the model "
                f"returned {describe(out)} without a loss; put the labels in the batch (labels=...), set "
                f"loss.output to where the loss is (loss.output: {suggest(out, 'loss.output')}), or set "
                "loss.step_fn to compute the loss yourself"
            )
        else:
            loss = pick_loss(out, self.output, call)
        logits = pick(out, self.logits, "loss.logits") if self.logits is not None else default_logits(out)
        targets = batch_or_targets.get("labels") if is_dict_batch else batch_or_targets
        return LossOutput(as_scalar(loss), outputs=logits, targets=targets)

    def _stand_in(self, model: torch.nn.Module, batch: Any, device: torch.device, non_blocking: bool) -> LossOutput:
        """The loss of two rows, times zero: the first row of the last batch this objective ran, twice
        (real data, which the model takes; two, as a batch norm in training needs more than one),
        or rows of zeros of the empty batch's shapes before any. The forward is inert (see
        ``_inert``): it exists only for the collectives in the model's backward."""
        last = self._last
        rows = take(last, torch.zeros(2, dtype=torch.long)) if last is not None else map_tensors(batch, _zero_rows)
        with _inert(model):
            out = self(model, rows, device, non_blocking)
        count = out.count * 0 if out.count is not None else None
        return LossOutput(
            out.loss * 0, is_sum=out.is_sum, count=count, metrics={k: v * 0 for k, v in out.metrics.items()}
        )


@contextmanager
def _inert(model: torch.nn.Module) -> Iterator[None]:
    """A forward that changes nothing a real one would: the model's buffers (batch-norm running
    statistics, counters) are put back, the random number generators too (dropout, noise drawn in
    ``forward``), and the users' forward hooks do not see it (torch's own, FSDP's, stay: the
    collectives need them). The modules stay in training mode: some models return their loss only there."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    held = []
    for registry in [
        *_hook_registries(model),
        torch.nn.modules.module._global_forward_hooks,
        torch.nn.modules.module._global_forward_pre_hooks,
    ]:
        users = [key for key, hook in registry.items() if not _is_torchs(hook)]
        if users:
            held.append((registry, dict(registry)))
            for key in users:
                del registry[key]
    try:
        yield
    finally:
        for registry, hooks in held:
            registry.clear()
            registry.update(hooks)
        for buffer, saved in buffers:  # through .data: the graph of this forward keeps its versions
            if not torch.equal(buffer, saved):
                buffer.data.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _hook_registries(model: torch.nn.Module) -> Iterator[dict]:
    for module in model.modules():
        yield module._forward_pre_hooks
        yield module._forward_hooks


def _is_torchs(hook: Any) -> bool:
    while isinstance(hook, functools.partial):
        hook = hook.func
    return (getattr(hook, "__module__", None) or "").startswith("torch.")


def _zero_rows(t: torch.Tensor) -> torch.Tensor:
    return t.new_zeros((2, *t.shape[1:])) if t.dim() > 0 else t


def is_label_key(key: str) -> bool:
    """Whether a batch key holds labels (counted, not summed, as ``loss.count_key``)."""
    return key.endswith("labels")


def _attribute_or_key(out: Any, name: str) -> Any:
    """``out.name`` or ``out[name]`` (a transformers output has both; a plain dict only the key)."""
    if isinstance(out, Mapping):
        return out.get(name)
    return None if isinstance(out, (tuple, list, torch.Tensor)) else getattr(out, name, None)


def _not_a_prediction(outputs: Any, exc: Exception) -> str:
    """What to set when ``loss_fn`` could not take what the model returned (a tuple, a dict)."""
    return (
        f"loss.target could not take what model(inputs) returned, {describe(outputs)} "
        f"({type(exc).__name__}: {first_line(exc, 120)}); set loss.output to where the model's own loss is "
        f"(loss.output: {suggest(outputs, 'loss.output')}; the model is then called as model(inputs, targets)), "
        f"or loss.logits to where its predictions are (loss.logits: {suggest(outputs, 'loss.logits')})"
    )


def _next_token_pairs(out: LossOutput) -> LossOutput:
    """A next-token model's logits and labels as its loss pairs them — position ``t``'s logits with
    label ``t + 1`` — for the configured metrics (a torchmetrics ``Perplexity`` then equals the
    exponential of the loss)."""
    logits, labels = out.outputs, out.targets
    if not (isinstance(logits, torch.Tensor) and isinstance(labels, torch.Tensor) and logits.dim() == labels.dim() + 1):
        return out
    return replace(out, outputs=logits[..., :-1, :], targets=labels[..., 1:])


def check_labels(outputs: Any, targets: Any, loss_fn: Any) -> None:
    """Class-index targets must be in ``[0, classes)`` (or the loss's ``ignore_index``).

    Checked on the loader's CPU tensor before the loss: out of range, ``cross_entropy`` fails
    with a bare ``IndexError`` on the CPU and a device-side assert that kills the CUDA context.
    Outputs ``[batch, classes]`` with targets ``[batch]``, or ``[batch, classes, ...]`` with a
    cross-entropy or NLL loss (whose layout puts the classes in dim 1).
    """
    if not (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return
    if (
        targets.is_floating_point()
        or targets.dtype == torch.bool
        or targets.numel() == 0
        or targets.device.type != "cpu"
    ):
        return  # a target already on the device is not checked: that would be a device sync
    is_plain = outputs.dim() == 2 and targets.dim() == 1
    if not (is_plain or (outputs.dim() == targets.dim() + 1 and _is_class_loss(loss_fn))):
        return
    num_classes = outputs.shape[1]
    low, high = torch.aminmax(targets)  # one pass; the common case ends here
    if int(low) >= 0 and int(high) < num_classes:
        return
    ignore = getattr(loss_fn, "ignore_index", -100)
    bad = ((targets < 0) | (targets >= num_classes)) & (targets != ignore)
    if bool(bad.any()):
        sample = int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0, 0])
        value = targets[sample][bad[sample]].reshape(-1)[0] if targets.dim() > 1 else targets[sample]
        raise LabelOutOfRange(int(value), int(num_classes), sample)


def _is_class_loss(loss_fn: Any) -> bool:
    return isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)) or loss_fn in (
        torch.nn.functional.cross_entropy,
        torch.nn.functional.nll_loss,
    )


def step_output(result: Any) -> LossOutput:
    """A step function's result as a ``LossOutput``: a scalar loss, ``(loss, {name: value})`` or a
    ``StepOutput`` (its ``state`` is the carrying wrapper's business, not the loss's).

    Raises:
        ConfigError: anything else — another tuple (``(loss_sum, count)`` and ``(loss, logits)``
            look alike: never guessed), a loss that is not one number, a count that is not.
    """
    if isinstance(result, StepOutput):
        count = result.count
        is_number = isinstance(count, (int, float)) and not isinstance(count, bool)
        if count is not None and not (is_number or is_scalar(count)):
            raise ConfigError(
                f"loss.step_fn returned StepOutput(count={describe(count)}); count must be one number: the "
                "elements the loss_sum is over"
            )
        loss = _step_loss(result.loss, f"StepOutput(loss={describe(result.loss)})")
        metrics = dict(result.metrics or {})
        return LossOutput(loss, count is not None, count, metrics, outputs=result.logits, targets=result.targets)
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        return LossOutput(_step_loss(result[0], describe(result)), metrics=dict(result[1]))
    if isinstance(result, (tuple, list)):
        raise ConfigError(
            f"loss.step_fn returned {describe(result)}; a tuple is read only as (loss, {{name: value}}): return "
            "torchkeel.StepOutput(loss_sum, count=n) for a sum over n elements, or "
            "StepOutput(loss, logits=..., targets=...) to give the metrics predictions"
        )
    return LossOutput(_step_loss(result, describe(result)))


def _step_loss(loss: Any, returned: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"loss.step_fn returned {returned}; return a scalar loss tensor, (loss, {{name: value}}) or "
            "torchkeel.StepOutput(loss, count=..., metrics=...)"
        )
    if not is_scalar(loss):
        raise ConfigError(
            f"loss.step_fn returned {returned}: a loss of {loss.numel()} numbers; return one: their mean, "
            "or their sum as torchkeel.StepOutput(loss_sum, count=n)"
        )
    return as_scalar(loss)
