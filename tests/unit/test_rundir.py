from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from keelproc import keel_env, run_keel
from test_trainer_checkpoints import SignalAt

import torchkeel as tk
from torchkeel.errors import RunDirError
from torchkeel.train.rundir import prepare_run_dir


def test_existing_run_is_never_silently_overwritten(tmp_path):
    run, _ = prepare_run_dir(tmp_path, "x")
    (run / "config.yaml").write_text("name: x\n")
    with pytest.raises(
        RunDirError,
        match="run directory '.*x' already exists; continue it with --resume auto, choose another name .* --overwrite",
    ):
        prepare_run_dir(tmp_path, "x")
    assert (run / "config.yaml").exists()
    _, previous = prepare_run_dir(tmp_path, "x", overwrite=True)
    assert not (run / "config.yaml").exists() and (previous.aside / "config.yaml").exists()
    previous.restore()
    assert (run / "config.yaml").exists() and not previous.aside.exists()


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(RunDirError, match="not a torchkeel run directory"):
        prepare_run_dir(tmp_path, "home", overwrite=True)
    assert (tmp_path / "home" / "thesis.tex").read_text() == "precious"


def test_an_empty_directory_is_used(tmp_path):
    (tmp_path / "empty").mkdir()
    assert prepare_run_dir(tmp_path, "empty") == (tmp_path / "empty", None)


def test_a_run_set_aside_by_a_killed_attempt_is_kept_over_that_attempt(tmp_path):
    run, _ = prepare_run_dir(tmp_path, "x")
    (run / "config.yaml").write_text("good")
    prepare_run_dir(tmp_path, "x", overwrite=True)  # ... and the new run is killed before a checkpoint
    (run / "config.yaml").write_text("attempt")
    _, previous = prepare_run_dir(tmp_path, "x", overwrite=True)
    assert (previous.aside / "config.yaml").read_text() == "good" and not (run / "config.yaml").exists()


def test_wall_s_is_the_whole_run_over_several_resumes_and_process_wall_s_this_process(tiny_config):
    """A run preempted twice and resumed twice: ``wall_s`` counts every process (in summary.json and
    in the rows, which run on across each resume), ``process_wall_s`` the one that wrote it."""
    options = ("train.max_epochs=3",)
    first = tk.Trainer(tiny_config(*options), model=SignalAt(9, signal.SIGTERM), progress=False).fit()
    second = tk.Trainer(tiny_config(*options), model=SignalAt(9, signal.SIGTERM), resume="auto", progress=False).fit()
    third = tk.Trainer(tiny_config(*options), model=SignalAt(0, signal.SIGTERM), resume="auto", progress=False).fit()
    assert [s["status"] for s in (first, second, third)] == ["preempted", "preempted", "completed"]
    assert first["wall_s"] == pytest.approx(first["process_wall_s"], abs=2e-3)
    assert second["wall_s"] == pytest.approx(first["wall_s"] + second["process_wall_s"], abs=2e-3)
    assert third["wall_s"] == pytest.approx(second["wall_s"] + third["process_wall_s"], abs=2e-3)
    assert json.loads((Path(third["run_dir"]) / "summary.json").read_text())["wall_s"] == third["wall_s"]
    walls = [r["wall_s"] for r in tk.read_metrics(Path(third["run_dir"]) / "metrics.jsonl")]
    assert walls == sorted(walls) and 0 < walls[-1] <= third["wall_s"]


def test_a_killed_process_s_time_counts_in_the_resumed_run_s_wall_s(tmp_path):
    """SIGKILLed 1.5 s after its last checkpoint: the resumed run redoes those steps, and its
    ``wall_s`` still counts the killed process's time up to its last row on disk."""
    (tmp_path / "cfg.yaml").write_text(KILLED_CONFIG)
    this_keel = {"PYTHONPATH": os.pathsep.join([str(Path(tk.__file__).parents[1]), keel_env()["PYTHONPATH"]])}
    faults = "sleep:15=1.5,kill:17"
    killed = run_keel(
        "train", "cfg.yaml", "--no-progress", cwd=tmp_path, TORCHKEEL_TEST_STEP_FAULTS=faults, **this_keel
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_dir = tmp_path / "runs" / "run"
    last_row_s = max(r["wall_s"] for r in tk.read_metrics(run_dir / "metrics.jsonl"))
    done = run_keel("train", "cfg.yaml", "--no-progress", "--resume", "auto", cwd=tmp_path, **this_keel)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["wall_s"] == pytest.approx(last_row_s + summary["process_wall_s"], abs=2e-3)
    assert summary["wall_s"] - summary["process_wall_s"] >= 1.5


KILLED_CONFIG = """\
name: run
out_dir: runs
model: {target: hand_written_loop:make_model}
data: {target: hand_written_loop:make_data, num_workers: 0}
train: {max_epochs: null, max_steps: 24, batch_size: 16, log_every: 1}
checkpoint: {every_steps: 10, every_s: 0}
"""
