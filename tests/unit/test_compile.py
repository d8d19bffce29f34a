from __future__ import annotations

import pytest
import torch
from torch import nn

import torchkeel as tk


def failing_backend(gm, example_inputs):
    raise RuntimeError("backend exploded")


def test_falls_back_to_eager_with_a_warning():
    model = nn.Linear(4, 2)
    wrapped = tk.CompiledOrEager(model, backend=failing_backend)
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="torch.compile failed .*backend exploded.*continuing in eager mode"):
        out = wrapped(x)
    assert wrapped.is_compiled is False
    torch.testing.assert_close(out, model(x))
    # Parameters are the model's own: training through the wrapper trains the model.
    assert list(wrapped.parameters()) == list(model.parameters())


def test_compiled_path_is_used_when_it_works():
    model = nn.Linear(4, 2)
    wrapped = tk.CompiledOrEager(model, backend="eager")
    x = torch.randn(3, 4)
    torch.testing.assert_close(wrapped(x), model(x))
    assert wrapped.is_compiled is True


def test_the_models_own_errors_still_raise():
    wrapped = tk.CompiledOrEager(nn.Linear(4, 2), backend=failing_backend)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        wrapped(torch.randn(3, 5))


@pytest.mark.slow
def test_trainer_trains_through_torch_compile(tiny_config):
    trainer = tk.Trainer(tiny_config("compile=true", "train.max_steps=6", "train.max_epochs=null"), progress=False)
    summary = trainer.fit()
    assert summary["status"] == "completed" and trainer.forward_model.is_compiled
