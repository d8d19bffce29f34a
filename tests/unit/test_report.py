"""keel report on real runs: every chart referenced and a real PNG of the expected size,
incidents and resumes marked, and a report even from an empty or half-written metrics file."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys

import pytest
from test_guards import NaNOnSteps

import torchkeel as tk
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
    charts = {"loss", "val_metrics", "lr", "grad_norm", "clip_frac", "throughput", "memory"}
    assert {p.stem for p in report.images} == charts
    for path in report.images:
        assert path.parent == tmp_path / "report" and png_size(path) == (800, 300)
    assert report.marks == [(7, "nonfinite"), (19, "nonfinite")]
    assert page.count("<td>nonfinite</td>") == 2 and "status</th><td>completed" in page
    assert report.missing == []


def test_a_resumed_preempted_run_is_marked(tiny_config, tmp_path):
    import signal

    from test_trainer_checkpoints import SignalAt

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
    (run / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 1, "loss": 2.0, "lr": 0.1}\n'
        '{"kind": "train", "step": 2, "loss": 1.5, "lr": 0.1}\n{"kind": "tra'
    )
    report = build_report(run)
    assert {p.stem for p in report.images} == {"loss", "lr"}
    assert any("summary.json" in m for m in report.missing)
    assert any("throughput" in m for m in report.missing)


def test_cli(run_with_incidents):
    result = subprocess.run(
        [sys.executable, "-m", "torchkeel.cli.main", "report", str(run_with_incidents)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.startswith(
        f"report: {run_with_incidents / 'report.html'} (7 charts)"
    )


def test_numbers_are_rounded_for_people_and_no_incidents_reads_none(tiny_config, tmp_path):
    import json

    tk.Trainer(tiny_config("memory.every_steps=5"), progress=False).fit()
    run = tmp_path / "runs" / "tiny"
    page = build_report(run, tmp_path / "report").path.read_text()
    cells = dict(re.findall(r"<tr><th>([^<]+)</th><td>([^<]*)</td></tr>", page))
    summary = json.loads((run / "summary.json").read_text())
    assert cells["incidents"] == "none"
    for key in ("val_loss", "wall_s"):
        digits = re.sub(r"e[+-]\d+$", "", cells[key]).replace(".", "").replace("-", "").lstrip("0")
        assert len(digits) <= 4 and float(cells[key]) == pytest.approx(summary[key], rel=1e-3), cells[key]


def test_format_value_and_memory_range():
    from torchkeel.report.build import format_value, memory_ylim

    assert format_value(0.021995102265504506) == "0.022" and format_value(123456.789) == "1.235e+05"
    assert format_value({}) == "none" and format_value({"nonfinite": 2, "leak": 1}) == "nonfinite: 2, leak: 1"
    assert format_value(15) == "15" and format_value([]) == "none"
    low, high = memory_ylim([0.4902, 0.4905, 0.4908])  # flat memory must look flat
    assert low == 0 and (0.4908 - 0.4902) / (high - low) < 0.01 and high >= 0.4908


def test_incident_kinds_are_told_apart_and_bad_samples_do_not_clutter_every_chart(tiny_config, tmp_path):
    import json

    tk.Trainer(tiny_config("memory.every_steps=5"), progress=False).fit()
    run = tmp_path / "runs" / "tiny"
    rows = [
        {"kind": "bad_sample", "step": step, "message": f"skipped a bad sample: row {step}"} for step in range(1, 40)
    ]
    rows += [
        {"kind": "spike", "step": 4, "message": "loss spike"},
        {"kind": "some_new_kind", "step": 6, "message": "?"},
    ]
    (run / "incidents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "resume", "step": 3}) + "\n")
    report = build_report(run, tmp_path / "report")
    assert report.drawn["loss"] == ["bad_sample", "resume", "some_new_kind", "spike"]
    assert report.drawn["memory"] == ["resume"] and report.drawn["lr"] == ["resume"]  # no bad samples there
    assert report.drawn["grad_norm"] == ["resume", "spike"]
    from torchkeel.report.build import colour

    kinds = ["bad_sample", "spike", "resume", "some_new_kind", "nonfinite", "rollback", "input_bound", "leak"]
    assert len({colour(k) for k in kinds}) == len(kinds)


def test_a_run_validated_by_its_loss_alone_misses_no_validation(tmp_path):
    run = tmp_path / "lm"
    run.mkdir()
    rows = [
        {"kind": "train", "step": s, "loss": 3.0 / s, "lr": 1e-3, "grad_norm": 1.0, "samples_per_s": 9.0}
        for s in range(1, 9)
    ]
    rows += [{"kind": "val", "step": 4, "val_loss": 1.5}, {"kind": "val", "step": 8, "val_loss": 1.2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"status": "completed", "steps": 8}))
    report = build_report(run, tmp_path / "report")
    assert not any("validation" in m for m in report.missing), report.missing
    assert "loss" in {p.stem for p in report.images}
