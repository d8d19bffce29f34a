"""Early stopping: stops at the validation the rule says, keeps the best checkpoint, and a run
killed before the stop and resumed stops at the same validation."""

from __future__ import annotations

import json

import pytest
from keelproc import run_keel

import torchkeel as tk
from torchkeel.checkpoint import CheckpointStore
from torchkeel.errors import ConfigError
from torchkeel.train.early_stop import EarlyStopping

# Validation 3 (step 6) is the best; 4, 5 and 6 do not beat it by more than 0.01: stop at step 12.
SCRIPT = "metrics=[{name: score, target: 'scriptedmetric:Scripted', args: {values: [0.5, 0.6, 0.7, 0.705, 0.65, 0.69, 0.9]}}]"


def test_rule_counts_validations_without_improvement():
    stopper = EarlyStopping("val_loss", "min", patience=2, min_delta=0.1)
    assert stopper.observe({"val_loss": 1.0}, 1)
    assert not stopper.observe({"val_loss": 0.95}, 2)  # not better by more than min_delta
    assert stopper.stop_reason is None
    assert stopper.observe({"val_loss": 0.8}, 3)
    assert not stopper.observe({"val_loss": 0.85}, 4) and not stopper.observe({"val_loss": float("nan")}, 5)
    assert "val_loss did not improve on 0.8 (step 3)" in stopper.stop_reason
    again = EarlyStopping("val_loss", "min", patience=2, min_delta=0.1)
    again.load_state_dict(stopper.state_dict())
    assert again.state_dict() == stopper.state_dict()
    with pytest.raises(ConfigError, match="val_f1"):
        EarlyStopping("val_f1", "max", 2).observe({"val_loss": 1.0}, 1)


def test_stops_at_the_expected_validation_and_keeps_the_best(tiny_config):
    config = tiny_config(
        SCRIPT,
        "train.max_epochs=10",
        "train.val_every=2",
        "train.early_stop.patience=3",
        "train.early_stop.min_delta=0.01",
        "checkpoint.monitor=val_score",
        "checkpoint.mode=max",
        "checkpoint.keep_last=1",
        "checkpoint.every_s=0",
    )
    trainer = tk.Trainer(config, progress=False)
    summary = trainer.fit()
    assert summary["status"] == "stopped_early" and summary["steps"] == 12
    assert summary["best_step"] == 6 and summary["best"] == 0.7
    assert "val_score did not improve on 0.7 (step 6)" in summary["reason"]
    on_disk = json.loads((trainer.run_dir / "summary.json").read_text())
    assert on_disk["status"] == "stopped_early" and on_disk["reason"] == summary["reason"]
    kept = {step for step, _ in CheckpointStore(trainer.run_dir / "checkpoints").steps()}
    assert kept == {6, 12}  # the best, and the state where it stopped


def test_patience_zero_is_off_and_errors_name_the_key(tiny_config):
    summary = tk.Trainer(tiny_config(SCRIPT, "train.max_epochs=2", "train.val_every=2"), progress=False).fit()
    assert summary["status"] == "completed"
    with pytest.raises(ConfigError, match="train.early_stop.patience"):
        tiny_config("train.early_stop.patience=-1").validate()
    with pytest.raises(ConfigError, match="train.early_stop.monitor"):
        tk.Trainer(
            tiny_config("name=other", "train.early_stop.patience=2", "train.early_stop.monitor=val_f1"), progress=False
        ).fit()


CONFIG = """
name: es
out_dir: runs
seed: 5
device: cpu
model: {target: hand_written_loop:make_model, args: {num_features: 2}}
data: {target: hand_written_loop:make_data, args: {num_features: 2}, num_workers: 0}
optim: {name: sgd, lr: 0.1}
schedule: {warmup_steps: 0, decay: constant}
train: {max_epochs: 30, batch_size: 16, val_every: 5, log_every: 5, early_stop: {patience: 2, min_delta: 0.002}}
checkpoint: {every_steps: 3, every_s: 0}
"""


def test_a_kill_before_the_stop_resumes_to_the_same_stop(tmp_path):
    for name in ("whole", "killed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cfg.yaml").write_text(CONFIG)
    done = run_keel("train", "cfg.yaml", "--no-progress", cwd=tmp_path / "whole")
    assert done.returncode == 0, done.stderr[-2000:]
    whole = json.loads((tmp_path / "whole" / "runs" / "es" / "summary.json").read_text())
    assert whole["status"] == "stopped_early" and whole["steps"] > 20
    # Killed 2 steps before the stop: the last checkpoint (every 3 steps) is after a validation
    # that did not improve, so the resumed run must carry the patience counter to stop in time.
    kill_at = whole["steps"] - 2
    killed = run_keel(
        "train", "cfg.yaml", "--no-progress", cwd=tmp_path / "killed", TORCHKEEL_TEST_STEP_FAULTS=f"kill:{kill_at}"
    )
    assert killed.returncode != 0
    resumed = run_keel("train", "cfg.yaml", "--no-progress", "--resume", "auto", cwd=tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = json.loads((tmp_path / "killed" / "runs" / "es" / "summary.json").read_text())
    for key in ("status", "steps", "best_step", "best", "reason", "val_loss"):
        assert again[key] == whole[key], key
    rows = [
        json.loads(line) for line in (tmp_path / "killed" / "runs" / "es" / "metrics.jsonl").read_text().splitlines()
    ]
    resumed_at = [r["step"] for r in rows if r["kind"] == "resume"]
    assert resumed_at and whole["best_step"] < resumed_at[0] < whole["steps"]
