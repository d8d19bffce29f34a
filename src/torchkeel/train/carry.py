"""State carried from one batch to the next: truncated backpropagation through time.

A recurrent language model reads a long stream in chunks, and the hidden state at the end of
one chunk is where the next chunk starts (pytorch/examples ``word_language_model``).
``CarriedState`` holds that state between calls of a step function
``step_fn(model, batch, state)`` that returns ``StepOutput(loss, state=new_state)``, and is
itself the ``(model, batch)`` step function an ``Objective`` calls::

    carry = CarriedState(step_fn)              # reset="epoch", eval=True
    objective = Objective(step_fn=carry)
    for epoch in range(num_epochs):
        carry.start_epoch()                    # the stream starts over: the state too
        for batch in loader:
            objective(model, batch, device).loss.backward()
            ...
        carry.start_eval()                     # validation starts from no state
        evaluate(model, val_batches, objective, device=device)

The rules:

- The new state is detached after each micro-batch (its tensors, in any nesting of tuples,
  lists, dicts): gradients flow through one batch's chunk only, and the previous graph is freed.
- Training and evaluation have a slot each, chosen by ``model.training``: a validation in the
  middle of an epoch leaves the training stream where it was. The evaluation slot starts empty
  at each ``start_eval``; with ``eval=False`` every evaluation batch gets ``None``.
- ``start_epoch`` empties the training slot when ``reset="epoch"``; ``reset="never"`` keeps it.
  ``reset_train`` empties it at once: the Trainer does after a step the non-finite guard skipped.
- ``state_dict`` holds the training slot (on the CPU): a checkpoint taken between steps resumes
  the stream exactly. Under torchrun each rank has its own.

What the data must give: row ``i`` of each batch continues row ``i`` of the batch before (the
layout of ``word_language_model``'s ``batchify``: the stream cut into ``batch_size`` columns,
each batch the next ``bptt`` tokens of every column), in order (``data.shuffle: false``), every
batch of the same number of rows. Under torchrun each rank takes the same rows of every batch,
so its state follows its own columns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import torch

from torchkeel.batch import map_tensors, to_device
from torchkeel.errors import ConfigError
from torchkeel.train.objective import StepOutput

Reset = Literal["epoch", "never"]


class CarriedState:
    """The state a step function carries across batches, and the ``(model, batch)`` step function
    that passes it in and keeps what comes back.

    Args:
        step_fn: ``(model, batch, state) -> StepOutput(loss, ..., state=new_state)``; ``state``
            is ``None`` at the start and after a reset.
        reset: ``"epoch"``: ``start_epoch`` empties the training state; ``"never"``: it does not.
        eval: evaluation carries a state of its own across its batches (else it gets ``None``).

    Raises:
        ConfigError: ``step_fn`` cannot take ``(model, batch, state)``.
    """

    def __init__(self, step_fn: Callable[..., Any], *, reset: Reset = "epoch", eval: bool = True) -> None:
        if reset not in ("epoch", "never"):
            raise ValueError(f"CarriedState(reset=) is 'epoch' or 'never', got {reset!r}")
        _check_takes_state(step_fn)
        self.step_fn, self.reset, self.eval = step_fn, reset, eval
        self.train_state: Any = None
        self.eval_state: Any = None

    def __call__(self, model: torch.nn.Module, batch: Any) -> StepOutput:
        """Run ``step_fn`` with the slot's state; keep its new state, detached; return its output
        less the state."""
        is_training = model.training
        state = self.train_state if is_training else self.eval_state
        out = self.step_fn(model, batch, state)
        if not isinstance(out, StepOutput) or out.state is None:
            got = "a StepOutput with state=None" if isinstance(out, StepOutput) else type(out).__name__
            raise ConfigError(
                f"train.carry.enabled is true but loss.step_fn returned {got}; return "
                "torchkeel.StepOutput(loss, state=new_state), or set train.carry.enabled=false"
            )
        carried = detach(out.state)
        if is_training:
            self.train_state = carried
        elif self.eval:
            self.eval_state = carried
        return replace(out, state=None)

    def start_epoch(self) -> None:
        """An epoch starts from its first batch: with ``reset="epoch"`` the state starts afresh."""
        if self.reset == "epoch":
            self.reset_train()

    def reset_train(self) -> None:
        """The training state starts afresh, whatever ``reset`` says (after a step the non-finite
        guard skipped: its state may be non-finite too)."""
        self.train_state = None

    def start_eval(self) -> None:
        """A validation starts: its batches carry a state from ``None``."""
        self.eval_state = None

    def state_dict(self) -> dict[str, Any]:
        """The training state, copied to the CPU (what a checkpoint holds)."""
        return {"train": map_tensors(self.train_state, lambda t: t.detach().cpu().clone())}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        """Continue from ``state_dict()``'s training state, moved to ``device``."""
        self.train_state = to_device(state.get("train"), torch.device(device))


def detach(state: Any) -> Any:
    """``state`` with every tensor detached from its graph (any nesting of tuples, lists, dicts)."""
    return map_tensors(state, torch.Tensor.detach)


def refuse_state(step_fn: Callable[..., Any]) -> Callable[[torch.nn.Module, Any], Any]:
    """``step_fn`` as it is, except that a ``StepOutput`` with a state is a ``ConfigError``: a
    state nothing carries would be dropped without a word."""

    def step(model: torch.nn.Module, batch: Any) -> Any:
        out = step_fn(model, batch)
        if isinstance(out, StepOutput) and out.state is not None:
            raise ConfigError(
                "loss.step_fn returned a state but train.carry.enabled is false; set train.carry.enabled=true "
                "to pass it to the next batch as step_fn(model, batch, state), or return state=None"
            )
        return out

    return step


def _check_takes_state(step_fn: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(step_fn)
    except (TypeError, ValueError):
        return  # a builtin or an extension: its call will say
    try:
        signature.bind(None, None, None)
    except TypeError:
        name = getattr(step_fn, "__qualname__", type(step_fn).__name__)
        raise ConfigError(
            f"train.carry.enabled is true: loss.step_fn {name}{signature} must take (model, batch, state) and "
            "return torchkeel.StepOutput(loss, state=new_state); add the state argument, or set "
            "train.carry.enabled=false"
        ) from None
