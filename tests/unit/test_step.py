"""The step's shape: ``train_step`` takes one settings object, the Trainer reaches ``backward()``
in three calls, and a micro-batch's forward and backward are written once."""

from __future__ import annotations

import ast
import inspect
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchkeel as tk
from torchkeel.train.hooks import TrainerHooks

SRC = Path(tk.__file__).resolve().parent


class Watched(nn.Module):
    """An MLP that records, during each backward, the torchkeel functions the backward was called from."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.callers: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if out.requires_grad:
            out.register_hook(self._record)
        return out

    def _record(self, grad: torch.Tensor) -> None:
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            path = Path(frame.f_code.co_filename).resolve()
            if path.is_relative_to(SRC):
                frames.append(f"{path.relative_to(SRC).as_posix()}:{frame.f_code.co_name}")
            frame = frame.f_back
        self.callers.append(frames[::-1])  # outermost first


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def calls_to_backward(callers: list[str], start: str) -> list[str]:
    """The functions from ``start`` to the one that calls ``backward()`` (``Precision.backward``
    is that call, written once for the scaler: not counted)."""
    chain = callers[callers.index(start) :]
    assert chain[-1] == "train/precision.py:backward", chain
    return chain[:-1]


def test_the_trainer_reaches_backward_in_three_calls(tmp_path):
    model = Watched()
    config = tk.load_config(
        None, [f"out_dir={tmp_path}", "train.max_epochs=1", "train.batch_size=16", "checkpoint.enabled=false"]
    )
    trainer = tk.Trainer(config, model=model, train_data=data(), overwrite=True, progress=False)
    trainer.fit()
    assert len(model.callers) == 4  # one backward a step
    for callers in model.callers:
        chain = calls_to_backward(callers, "train/trainer.py:_step")
        assert len(chain) <= 3, f"the Trainer reaches backward() through {len(chain)} calls: {' -> '.join(chain)}"


def test_train_step_takes_its_settings_as_one_object_and_reaches_backward_in_two_calls():
    parameters = inspect.signature(tk.train_step).parameters
    assert len(parameters) <= 6 and "settings" in parameters, list(parameters)
    for micro_batch_size in (None, 8):  # whole micro-batches, and cut in pieces
        torch.manual_seed(0)
        model = Watched()
        settings = tk.StepSettings(
            params=list(model.parameters()), precision=tk.Precision(), device=torch.device("cpu")
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        group = [data(16).tensors, data(16).tensors]
        result = tk.train_step(model, optimizer, group, nn.functional.cross_entropy, settings, micro_batch_size)
        assert result.status == "ok" and result.num_samples == 32
        assert len(model.callers) == (2 if micro_batch_size is None else 4)  # one backward a piece
        for callers in model.callers:
            chain = calls_to_backward(callers, "train/step.py:train_step")
            assert chain == ["train/step.py:train_step", "train/passes.py:forward_backward"], chain


def test_a_pieces_forward_and_backward_are_written_once():
    """One call of the objective and one of ``backward`` in the step's modules: no fast path
    that restates them."""
    calls = {"objective": [], "backward": []}
    for name in ("step.py", "passes.py"):
        for node in ast.walk(ast.parse((SRC / "train" / name).read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called in calls:  # objective(...), work.objective(...), precision.backward(...)
                    calls[called].append(f"{name}:{node.lineno}")
    assert len(calls["objective"]) == 1 and len(calls["backward"]) == 1, calls


class FailsOnceInBackward(torch.autograd.Function):
    """The identity; its first backward runs out of memory (as a large activation's would)."""

    failed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if not FailsOnceInBackward.failed:
            FailsOnceInBackward.failed = True
            raise torch.OutOfMemoryError("out of memory in the backward")
        return grad


def test_an_attempt_that_ran_out_of_memory_is_freed_before_the_redo():
    """The redo loop runs in the frame of the passes: the failed attempt's outputs and graph must
    not stay alive in it while the smaller pieces run (on a GPU they hold the memory the redo needs)."""
    outputs = []

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = FailsOnceInBackward.apply(self.linear(x))
            outputs.append(weakref.ref(out))
            return out

    model, alive = Net(), []
    hooks = TrainerHooks(before_forward=lambda n: alive.append([ref() is not None for ref in outputs]))
    settings = tk.StepSettings(
        list(model.parameters()), tk.Precision(), torch.device("cpu"), split_on_oom=True, hooks=hooks
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    result = tk.train_step(model, optimizer, [batch], nn.functional.cross_entropy, settings)
    assert (result.status, result.micro_batch_size, result.num_oom_splits) == ("ok", 4, 1)
    assert alive == [[], [False], [False, True]]  # the failed attempt's output is gone before the redo's first piece


def test_a_step_function_that_mixes_a_mean_and_a_sum_within_a_step_is_one_config_error():
    def step_fn(model, batch):
        x, y = batch
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        return losses.mean() if int(x[0, 0] > 0) else tk.StepOutput(losses.sum(), count=len(y))

    model = nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    x[0, 0], x[4, 0] = 1.0, -1.0  # the first micro-batch returns a mean, the second a sum
    group = [(x[:4], y[:4]), (x[4:], y[4:])]
    settings = tk.StepSettings(params=list(model.parameters()), precision=tk.Precision(), device=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tk.ConfigError, match="a mean for one micro-batch and a StepOutput with a count") as caught:
        tk.train_step(model, optimizer, group, tk.Objective(step_fn=step_fn), settings)
    assert "\n" not in str(caught.value)
