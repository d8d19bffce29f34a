"""TensorBoard event files and plugged-in loggers get every metrics.jsonl scalar at its step,
the incidents and the config; read back with TensorBoard's own reader."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import recordinglogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import torchkeel as tk
from torchkeel.errors import ConfigError, RunDirError

# A memory threshold every process exceeds: a `memory` incident at each memory row.
BUSY = ("train.max_epochs=2", "train.log_every=3", "memory.every_steps=5", "memory.warn_rss_gb=0.001")


def rows_of(run_dir, kind):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind", "train") == kind]


def test_tensorboard_holds_every_scalar_at_its_step(tiny_config):
    trainer = tk.Trainer(tiny_config("logging.tensorboard=true", *BUSY), progress=False)
    trainer.fit()
    events = EventAccumulator(str(trainer.run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for kind, key in (
        ("train", "loss"),
        ("train", "lr"),
        ("train", "grad_norm"),
        ("train", "samples_per_s"),
        ("train", "epoch"),
        ("train", "wall_s"),
        ("val", "val_loss"),
        ("val", "wall_s"),
        ("val", "val_accuracy"),
        ("memory", "rss_bytes"),
    ):
        expected = [(r["step"], r[key]) for r in rows_of(trainer.run_dir, kind)]
        got = [(e.step, e.value) for e in events.Scalars(f"{kind}/{key}")]
        assert [s for s, _ in got] == [s for s, _ in expected] and expected, key
        assert all(v == pytest.approx(w, rel=1e-6) for (_, v), (_, w) in zip(got, expected)), key
    tags = events.Tags()["tensors"]
    incidents = [e for e in events.Tensors("incidents/text_summary")]
    assert "config/text_summary" in tags and incidents
    assert b"memory:" in incidents[0].tensor_proto.string_val[0]
    memory_steps = [json.loads(line)["step"] for line in (trainer.run_dir / "incidents.jsonl").read_text().splitlines()]
    assert [e.step for e in incidents] == memory_steps


def test_a_plugged_in_logger_gets_the_rows_incidents_and_close(tiny_config):
    recordinglogger.RECORDED.clear()
    trainer = tk.Trainer(tiny_config("logging.loggers=[recordinglogger:Recording]", *BUSY), progress=False)
    trainer.fit()
    (logger,) = recordinglogger.RECORDED
    assert logger.closed and logger.run_dir == trainer.run_dir and logger.config["name"] == "tiny"
    train_rows = rows_of(trainer.run_dir, "train")
    logged = [(s, v["train/loss"]) for s, v in logger.metrics if "train/loss" in v]
    assert logged == [(r["step"], r["loss"]) for r in train_rows]
    every = [(s, v["train/epoch"], v["train/wall_s"]) for s, v in logger.metrics if "train/loss" in v]
    assert every == [(r["step"], r["epoch"], r["wall_s"]) for r in train_rows]  # every scalar, these two too
    assert [r["kind"] for r in logger.incidents] and {r["kind"] for r in logger.incidents} == {"memory"}


def test_a_logger_without_the_methods_is_a_config_error(tiny_config):
    with pytest.raises(ConfigError, match=r"logging.loggers\[0\]"):
        tk.Trainer(tiny_config("logging.loggers=[recordinglogger:not_a_logger]"), progress=False).fit()


def test_metrics_rows_reach_the_file_at_flush_or_at_once_with_no_interval(tmp_path):
    buffered = tk.MetricsWriter(tmp_path / "a.jsonl", flush_every_s=3600)
    buffered.write({"kind": "train", "step": 1, "loss": float("nan")})
    assert (tmp_path / "a.jsonl").read_text() == ""  # within the interval: not yet a system call
    buffered.flush()
    assert tk.read_metrics(tmp_path / "a.jsonl") == [{"kind": "train", "step": 1, "loss": None}]
    buffered.write({"kind": "train", "step": 2})
    buffered.close()
    assert [r["step"] for r in tk.read_metrics(tmp_path / "a.jsonl")] == [1, 2]
    eager = tk.MetricsWriter(tmp_path / "b.jsonl", flush_every_s=0)
    eager.write({"kind": "train", "step": 1})
    assert [r["step"] for r in tk.read_metrics(tmp_path / "b.jsonl")] == [1]
    eager.close()


def test_metrics_rows_of_a_writer_never_closed_are_written_when_it_goes_or_the_process_exits(tmp_path):
    writer = tk.MetricsWriter(tmp_path / "collected.jsonl", flush_every_s=3600)
    writer.write({"kind": "train", "step": 7})
    del writer
    gc.collect()
    assert [r["step"] for r in tk.read_metrics(tmp_path / "collected.jsonl")] == [7]
    script = "import torchkeel as tk; w = tk.MetricsWriter(r'%s', flush_every_s=3600); w.write({'step': 8})" % (
        tmp_path / "exited.jsonl"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert [r["step"] for r in tk.read_metrics(tmp_path / "exited.jsonl")] == [8]


def test_a_run_that_failed_before_its_first_step_is_taken_over_by_a_rerun(tiny_config):
    with pytest.raises(ConfigError, match="logging.loggers"):
        tk.Trainer(tiny_config("logging.loggers=[recordinglogger:not_a_logger]"), progress=False).fit()
    run_dir = tiny_config().out_dir
    assert (Path(run_dir) / "tiny" / "config.yaml").exists()  # what the failed start left
    summary = tk.Trainer(tiny_config(), progress=False).fit()  # no --overwrite needed
    assert summary["status"] == "completed"
    with pytest.raises(RunDirError, match="already exists"):  # a run that trained is kept
        tk.Trainer(tiny_config(), progress=False).fit()
