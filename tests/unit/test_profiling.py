"""``profile.steps``: a torch.profiler trace of exactly those steps, a summary of where their time
went, the report's table; nothing left on the model afterwards."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchkeel as tk
from torchkeel.errors import ConfigError
from torchkeel.report import build_report
from torchkeel.train.profiling import read_summary


def fit(tmp_path, *overrides, steps=8):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 16, 8, generator=g), torch.randint(0, 3, (steps * 16,), generator=g))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    config = tk.load_config(
        None,
        [f"out_dir={tmp_path}", "train.batch_size=16", "data.num_workers=0", "checkpoint.enabled=false", *overrides],
    )
    tk.Trainer(config, model=model, train_data=data, progress=False).fit()
    return model, tmp_path / "run"


def test_the_steps_asked_for_are_traced_and_summarized(tmp_path, capsys):
    model, run = fit(tmp_path, "profile.steps=[3, 5]")
    (trace,) = (run / "profile").glob("rank0.*.pt.trace.json")  # TensorBoard's profiler plugin layout
    events = json.loads(trace.read_text())["traceEvents"]  # Chrome trace JSON (Perfetto opens it)
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 3
    assert any(e.get("name") == "aten::addmm" for e in events)
    summary = read_summary(run)
    assert summary["steps"] == [3, 5] and summary["step_ms"] > 0
    split = summary["split_ms"]
    assert all(split[k] > 0 for k in ("forward", "backward", "optimizer"))
    assert sum(split.values()) == pytest.approx(summary["step_ms"])
    assert summary["host_syncs_per_step"] == 0  # on the CPU nothing waits for a device
    assert "aten::addmm" in [op["name"] for op in summary["top_ops"]]
    assert "keel: profiled steps 3-5: " in capsys.readouterr().err
    assert not model._forward_hooks and not model._forward_pre_hooks  # the forward's timing hooks are gone


def test_a_window_past_the_end_of_the_run_closes_with_it(tmp_path):
    _, run = fit(tmp_path, "profile.steps=[6, 100]", steps=8)
    assert read_summary(run)["steps"] == [6, 8]


def test_no_profile_writes_nothing_and_the_report_shows_the_profile(tmp_path):
    pytest.importorskip("matplotlib")  # the report extra, which make setup installs
    _, run = fit(tmp_path / "plain")
    assert not (run / "profile").exists() and read_summary(run) is None
    _, run = fit(tmp_path / "profiled", "profile.steps=[2, 3]")
    page = build_report(run).path.read_text()
    assert "<h2>Profile</h2><p>profiled steps 2-3: " in page and "<td>aten::addmm</td>" in page


@pytest.mark.parametrize("steps", ["[0, 3]", "[5, 3]", "[4]"])
def test_profile_steps_must_be_a_window_counted_from_1(steps):
    with pytest.raises(ConfigError, match=r"profile.steps must be \[start, end\] with 1 <= start <= end"):
        tk.load_config(None, [f"profile.steps={steps}"])
