"""keel report on real runs: every chart referenced and a real PNG of the expected size,
incidents and resumes marked, and a report even from an empty or half-written metrics file."""

from __future__ import annotations

import re
import struct
import subprocess
import sys

import pytest

import torchkeel as tk
from test_guards import NaNOnSteps
from torchkeel.report import build_report


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def run_with_incidents(tiny_config, tmp_path):
    config = tiny_config("memory.every_steps=5", "train.log_every=2")
    tk.Trainer(config, model=NaNOnSteps([7, 19]), progress=False).fit()
    return tmp_path / "runs" / "tiny"


def test_report_of_a_real_run_with_incidents(run_with_incidents, tmp_path):
    report = build_report(run_with_incidents, tmp_path / "report")
    page = report.path.read_text()
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(sources) == sorted(p.name for p in report.images)
    assert {p.stem for p in report.images} == {"loss", "val_metrics", "lr", "grad_norm", "throughput", "memory"}
    for path in report.images:
        assert path.parent == tmp_path / "report" and png_size(path) == (800, 300)
    assert report.marks == [(7, "nonfinite"), (19, "nonfinite")]
    assert page.count("<td>nonfinite</td>") == 2 and "status</th><td>completed" in page
    assert report.missing == []


def test_a_resumed_preempted_run_is_marked(tiny_config, tmp_path):
    from test_trainer_checkpoints import SignalAt
    import signal

    tk.Trainer(tiny_config(), model=SignalAt(9, signal.SIGTERM), progress=False).fit()
    report = build_report(tmp_path / "runs" / "tiny")
    assert (9, "preempted") in report.marks  # forward 9 is step 9: the step finished, then the stop
    tk.Trainer(tiny_config(), model=SignalAt(0, signal.SIGTERM), resume="auto", progress=False).fit()
    assert any(k == "resume" for _, k in build_report(tmp_path / "runs" / "tiny").marks)


def test_empty_and_half_written_metrics_still_give_a_report(tmp_path):
    run = tmp_path / "killed"
    run.mkdir()
    report = build_report(run)
    assert report.path.exists() and report.images == []
    assert any("metrics.jsonl" in m for m in report.missing) and any("summary.json" in m for m in report.missing)
    assert "nothing was logged yet" in report.path.read_text()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0, "lr": 0.1}\n'
                                       '{"kind": "train", "step": 2, "loss": 1.5, "lr": 0.1}\n{"kind": "tra')
    report = build_report(run)
    assert {p.stem for p in report.images} == {"loss", "lr"}
    assert any("summary.json" in m for m in report.missing)
    assert any("throughput" in m for m in report.missing)


def test_cli(run_with_incidents):
    result = subprocess.run([sys.executable, "-m", "torchkeel.cli.main", "report", str(run_with_incidents)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith(f"report: {run_with_incidents / 'report.html'} (6 charts)")
