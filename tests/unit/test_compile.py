from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import torchkeel as tk
from torchkeel.errors import ConfigError
from torchkeel.train.compile import CompileError


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


class Branchy(nn.Module):
    """A data-dependent Python branch: torch.compile cannot keep it in one graph."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        out = self.net(x)
        if out.sum() > 0:  # the graph breaks here
            out = out * 2
        return out


BRANCH_LINE = Branchy.forward.__code__.co_firstlineno + 2


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_graph_break_is_an_incident_naming_the_line_and_the_compile_time_is_logged(tiny_config):
    config = tiny_config("compile={enabled: true, backend: eager}", "train.max_steps=4", "train.max_epochs=null")
    trainer = tk.Trainer(config, model=Branchy(), progress=False)
    assert trainer.fit()["status"] == "completed"
    breaks = [r for r in read_rows(trainer.run_dir / "incidents.jsonl") if r["kind"] == "graph_break"]
    assert breaks and breaks[0]["line"] == BRANCH_LINE and breaks[0]["file"].endswith("test_compile.py")
    assert f"test_compile.py:{BRANCH_LINE}" in breaks[0]["message"]
    timed = [r for r in read_rows(trainer.run_dir / "metrics.jsonl") if r.get("kind") == "compile"]
    assert len(timed) == 1 and timed[0]["compile_s"] > 0 and timed[0]["mode"] == "default"


def test_fullgraph_turns_the_break_into_an_error_naming_it(tiny_config):
    config = tiny_config(
        "compile={enabled: true, backend: eager, fullgraph: true}", "train.max_steps=2", "train.max_epochs=null"
    )
    with pytest.raises(CompileError, match=rf"graph breaks at .*test_compile.py:{BRANCH_LINE}"):
        tk.Trainer(config, model=Branchy(), progress=False).fit()


def test_compile_settings_and_the_boolean_short_form(tiny_config):
    assert tiny_config("compile=true").compile.enabled is True
    c = tiny_config("compile={enabled: true, mode: max-autotune, dynamic: false}").compile
    assert (c.mode, c.dynamic, c.fullgraph) == ("max-autotune", False, False)
    with pytest.raises(ConfigError, match="compile.mode"):
        tiny_config("compile={enabled: true, mode: fastest}")


def test_a_fallback_is_reported_not_warned_when_a_reporter_is_given():
    events = []
    model = nn.Linear(4, 2)
    wrapped = tk.CompiledOrEager(
        model, backend=failing_backend, report=lambda kind, message, details: events.append((kind, message, details))
    )
    x = torch.randn(3, 4)
    torch.testing.assert_close(wrapped(x), model(x))
    ((kind, message, details),) = [e for e in events if e[0] == "compile"]
    assert "backend exploded" in message and details == {"fallback": "eager", "error": "BackendCompilerFailed"}
