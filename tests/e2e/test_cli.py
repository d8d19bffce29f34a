"""``keel``: exit codes, one-line errors, run files, the demo. Each command runs once as a
subprocess, as a user runs it (``keel``); the other checks call the same ``main`` in the test's
process (``keel_main``), where no process boundary is needed."""

from __future__ import annotations

import json

import pytest
from keelmain import keel_main  # noqa: F401 - a fixture
from keelproc import run_keel as keel

import torchkeel

TINY = """\
name: tiny
model:
  target: hand_written_loop:make_model
data:
  target: hand_written_loop:make_data
train:
  max_epochs: 1
  batch_size: 32
  log_every: 2
"""


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def test_train_writes_metrics_config_and_summary(cfg, tmp_path):
    result = keel("train", str(cfg), "optim.lr=3e-3", "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "tiny"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 15 and summary["epochs"] == 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [2, 4, 6, 8, 10, 12, 14, 15]
    assert rows[-1]["kind"] == "val" and rows[-1]["val_accuracy"] == summary["val_accuracy"]
    assert "optim:\n  name: adamw\n" in (run / "config.yaml").read_text()
    assert "lr: 0.003" in (run / "config.yaml").read_text()
    assert result.stdout.startswith("status completed | val_accuracy ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train.batchsize=8"], "unknown config key 'train.batchsize'; did you mean 'train.batch_size'?"),
        (["train.batch_size=eight"], "train.batch_size must be an integer, got 'eight' (str)"),
        (["model.target=nowhere:Net"], "model.target='nowhere:Net': cannot import module 'nowhere'"),
        (
            ["model.target=builtins:list"],
            "model.target='builtins:list' returned list; it must return a torch.nn.Module",
        ),
    ],
)
def test_config_errors_exit_2_with_one_line(keel_main, cfg, tmp_path, args, message):
    result = keel_main("train", str(cfg), *args, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"keel: error: {message}")
    assert not (tmp_path / "runs" / "tiny").exists()


def test_debug_shows_the_traceback(keel_main, cfg, tmp_path):
    result = keel_main("train", str(cfg), "train.batchsize=8", "--debug", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.strip().endswith("did you mean 'train.batch_size'?")


def test_existing_run_dir_exits_2_unless_overwrite(keel_main, cfg, tmp_path):
    assert keel_main("train", str(cfg), "train.max_epochs=null", "train.max_steps=2", cwd=tmp_path).returncode == 0
    again = keel_main("train", str(cfg), cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr and "--overwrite" in again.stderr
    assert keel_main("train", str(cfg), "--overwrite", "--no-progress", cwd=tmp_path).returncode == 0


def test_missing_config_file_and_usage_errors(keel_main, tmp_path):
    missing = keel_main("train", "nope.yaml", cwd=tmp_path)
    assert missing.returncode == 2 and "config file 'nope.yaml' not found" in missing.stderr
    assert keel_main(cwd=tmp_path).returncode == 2  # no subcommand: argparse usage error


def test_version(tmp_path):
    result = keel("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"torchkeel {torchkeel.__version__}"


def test_demo_reaches_95_percent_and_runs_again(keel_main, tmp_path):
    # `keel demo` can be run again and again: a short first run in this process, then the command
    first = keel_main("demo", "--out-dir", str(tmp_path / "runs"), "--no-progress", "train.max_epochs=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    result = keel(
        "demo", "--out-dir", str(tmp_path / "runs"), "--no-progress", "train.max_epochs=12", cwd=tmp_path, timeout=300
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "runs" / "demo" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["val_accuracy"] >= 0.95
    assert "validation accuracy" in result.stdout
    assert "export: parity passed" in result.stdout
    served = [line for line in result.stdout.splitlines() if line.startswith("served ")]
    png = tmp_path / "runs" / "demo" / "digit.png"
    assert len(served) == 1 and served[0].startswith(f"served {png} ") and "KServe v1 image_bytes): digit " in served[0]
    digit, truth = served[0].split("): digit ")[1].split(" (score")[0], served[0].rsplit("true label ", 1)[1]
    assert digit == truth  # the demo's model reads the PNG of the first validation digit right
    assert png.read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "runs" / "demo" / "export-torchscript" / "model.json").is_file()
    assert result.stdout.strip().endswith(f"report: {tmp_path / 'runs' / 'demo' / 'report.html'}")
    assert (tmp_path / "runs" / "demo" / "loss.png").is_file()


def test_resume_from_a_corrupt_checkpoint_exits_3_with_one_line(keel_main, cfg, tmp_path):
    assert keel_main("train", str(cfg), "train.max_epochs=null", "train.max_steps=2", cwd=tmp_path).returncode == 0
    checkpoint = tmp_path / "runs" / "tiny" / "checkpoints" / "step-00000002"
    model_file = checkpoint / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-1])
    result = keel_main("train", str(cfg), "--resume", str(checkpoint), cwd=tmp_path)
    assert result.returncode == 3
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"keel: error: checkpoint file '{model_file}' has {model_file.stat().st_size} bytes, "
        f"the manifest says {model_file.stat().st_size + 1} (truncated?)"
    ]


def test_export_and_triton_repo_commands(keel_main, cfg, tmp_path):
    assert keel_main("train", str(cfg), "train.max_epochs=null", "train.max_steps=3", cwd=tmp_path).returncode == 0
    result = keel("export", "runs/tiny", "--format", "onnx", "--out", "exp", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("parity passed: max abs error")
    repo = keel("triton-repo", "exp", "repo", cwd=tmp_path)
    assert repo.returncode == 0 and (tmp_path / "repo" / "tiny" / "config.pbtxt").is_file()
    wrong = keel_main("export", "runs/nope", "--format", "onnx", cwd=tmp_path)
    assert wrong.returncode == 2 and "neither a run directory" in wrong.stderr


def test_export_parity_failure_exits_4(keel_main, cfg, tmp_path):
    assert (
        keel_main(
            "train",
            str(cfg),
            "model.target=models:HardcodedBatch",
            "train.max_epochs=null",
            "train.max_steps=2",
            cwd=tmp_path,
        ).returncode
        == 0
    )
    result = keel_main("export", "runs/tiny", "--format", "torchscript", cwd=tmp_path)
    assert result.returncode == 4
    assert "parity FAILED on output 'output' at batch size 1" in result.stderr


def test_init_from_a_malicious_pickle_is_refused(keel_main, cfg, tmp_path):
    import os

    import torch

    marker = tmp_path / "code-ran"
    payload = tmp_path / "evil.pt"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"w": Evil()}, payload)
    result = keel_main("train", str(cfg), "--init-from", str(payload), cwd=tmp_path)
    assert result.returncode == 3
    assert "disallowed global 'posix.system'" in result.stderr
    assert not marker.exists()


def test_overrides_after_flags_are_parsed_as_overrides(capsys):
    from torchkeel.cli.main import parse_args

    args = parse_args(
        ["train", "cfg.yaml", "--overwrite", "train.max_epochs=null", "--no-progress", "train.max_steps=4"]
    )
    assert args.overrides == ["train.max_epochs=null", "train.max_steps=4"] and args.overwrite and args.no_progress
    for argv, message in (
        (["train", "cfg.yaml", "--overwrite", "--bogus"], "unrecognized arguments: --bogus"),
        (["doctor", "train.max_steps=4"], "unrecognized arguments: train.max_steps=4"),
    ):
        with pytest.raises(SystemExit) as exited:
            parse_args(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # the same as subprocesses; the parsing is tested in process above
def test_overrides_after_flags(cfg, tmp_path):
    first = keel("train", str(cfg), "--no-progress", "train.max_epochs=null", "train.max_steps=3", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = keel(
        "train", str(cfg), "--overwrite", "train.max_epochs=null", "--no-progress", "train.max_steps=4", cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr
    summary = json.loads((tmp_path / "runs" / "tiny" / "summary.json").read_text())
    assert summary["steps"] == 4
    wrong = keel("train", str(cfg), "--overwrite", "--bogus", cwd=tmp_path)
    assert wrong.returncode == 2 and "unrecognized arguments: --bogus" in wrong.stderr
    assert keel("doctor", "train.max_steps=4", cwd=tmp_path).returncode == 2  # doctor takes no overrides


BROKEN_DATA = """\
import torch
from torch.utils.data import Dataset

from torchkeel.errors import DataError


class Broken(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        raise DataError(f"sample {i} cannot be decoded")


def make_data():
    return Broken(), Broken()
"""


def test_a_failing_overwrite_rerun_puts_the_previous_run_back(keel_main, cfg, tmp_path):
    from torchkeel.checkpoint import CheckpointStore

    assert keel_main("train", str(cfg), "--no-progress", cwd=tmp_path).returncode == 0
    run = tmp_path / "runs" / "tiny"
    assert keel_main("export", str(run), "--format", "torchscript", cwd=tmp_path).returncode == 0
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    (tmp_path / "broken.py").write_text(BROKEN_DATA)
    failed = keel_main("train", str(cfg), "--overwrite", "data.target=broken:make_data", "--no-progress", cwd=tmp_path)
    assert failed.returncode == 1
    line = failed.stderr.strip().splitlines()[-1]
    assert "cannot be decoded" in line and "the previous run was put back in 'runs/tiny'" in line
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    found, problems = CheckpointStore(run / "checkpoints").latest_valid()
    assert found is not None and problems == [] and found.step == 15
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert not (tmp_path / "runs" / ".tiny.previous").exists()
    ok = keel_main(
        "train", str(cfg), "--overwrite", "train.max_epochs=null", "train.max_steps=2", "--no-progress", cwd=tmp_path
    )
    assert ok.returncode == 0 and not (tmp_path / "runs" / ".tiny.previous").exists()
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def test_serve_usage_errors_exit_2_with_one_line(keel_main, tmp_path):
    import socket

    missing = keel_main("serve", str(tmp_path / "nope"), "--grpc-port", "0", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "no model could be loaded" in missing.stderr and "not a directory" in missing.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = keel_main("serve", str(tmp_path), "--port", "0", "--grpc-port", str(port), cwd=tmp_path)
    assert busy.returncode == 2 and f"--grpc-port {port}: cannot listen on 127.0.0.1:{port}" in busy.stderr


def test_export_image_flags_become_a_preprocess_spec():
    import argparse

    from torchkeel.cli import export as export_cli
    from torchkeel.errors import ConfigError

    parser = argparse.ArgumentParser()
    export_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "run",
            "--format",
            "onnx",
            "--image-mode",
            "RGB",
            "--resize",
            "256",
            "--crop",
            "224,200",
            "--mean",
            "0.5,0.4,0.3",
            "--std",
            "0.2,0.2,0.2",
        ]
    )
    assert export_cli._preprocess(args) == {
        "mode": "RGB",
        "resize": [256],
        "crop": [224, 200],
        "mean": [0.5, 0.4, 0.3],
        "std": [0.2, 0.2, 0.2],
    }
    with pytest.raises(ConfigError, match="--resize need --image-mode RGB or L"):
        export_cli._preprocess(parser.parse_args(["run", "--format", "onnx", "--resize", "224"]))
    with pytest.raises(ConfigError, match="--mean must be comma-separated floats"):
        export_cli._preprocess(parser.parse_args(["run", "--format", "onnx", "--image-mode", "L", "--mean", "a"]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train.batch_size=eight"], "train.batch_size must be an integer, got 'eight' (str)"),
        (["model.target=nowhere:Net"], "model.target='nowhere:Net': cannot import module 'nowhere'"),
        (["model.args={width: 3}"], "model.args.width is not an argument of hand_written_loop:make_model"),
        (["train.batch_size=33"], "train.batch_size 33 does not divide by the world size 2"),
    ],
)
def test_a_config_error_under_nproc_is_said_once_before_any_rank_starts(keel_main, cfg, tmp_path, args, message):
    result = keel_main("train", str(cfg), *args, "--nproc", "2", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"keel: error: {message}"), result.stderr
    assert not (tmp_path / "runs").exists()


def test_an_existing_run_directory_under_nproc_is_said_once_before_any_rank_starts(keel_main, cfg, tmp_path):
    assert keel_main("train", str(cfg), "train.max_epochs=null", "train.max_steps=2", cwd=tmp_path).returncode == 0
    result = keel_main("train", str(cfg), "train.max_epochs=null", "train.max_steps=2", "--nproc", "2", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keel: error: run directory 'runs/"), result.stderr
    assert "already exists; continue it with --resume auto" in lines[0]


def test_keel_train_chooses_the_thread_count_and_says_so(cfg, tmp_path):
    from torchkeel.env.cpus import cgroup_cpus, usable_cpus

    usable = usable_cpus(quota=cgroup_cpus())
    result = keel("train", str(cfg), "train.max_epochs=null", "train.max_steps=2", cwd=tmp_path, OMP_NUM_THREADS="")
    assert result.returncode == 0, result.stderr
    assert (
        f"keel: torch threads: {usable} per process ({usable} usable CPUs; set OMP_NUM_THREADS to choose)"
        in result.stderr
    )
    # Every other test here sets OMP_NUM_THREADS=1 (keelproc), and prints no such line: the user chose.


def test_exit_codes_of_a_summary():
    from torchkeel.cli.train import exit_code

    assert [exit_code({"status": s}) for s in ("completed", "stopped_early", "failed", "interrupted")] == [0, 0, 1, 1]
    assert exit_code({"status": "preempted", "signal": "SIGINT"}) == 130
    assert exit_code({"status": "preempted", "signal": "SIGTERM"}) == 143
