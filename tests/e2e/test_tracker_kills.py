"""``keel train`` with TensorBoard, MLflow (a SQLite store) and W&B (offline), killed with SIGKILL
at random moments after its checkpoints and resumed with ``--resume auto``: each tracker ends
holding every scalar of ``metrics.jsonl`` once, at its step, with its value."""

from __future__ import annotations

import collections
import json
import random
import time
from pathlib import Path

import pytest
from keelproc import run_keel, start_keel

mlflow = pytest.importorskip("mlflow")  # in the dev extra, which make setup installs
wandb = pytest.importorskip("wandb")
from mlflow import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from test_wandb import Offline  # noqa: E402

CONFIG = """\
name: run
seed: 5
model: {{target: hand_written_loop:make_model}}
data: {{target: chaosdata:make_data, args: {{delay_s: 0.002}}, num_workers: 0}}
optim: {{lr: 3.0e-3}}
schedule: {{warmup_steps: 3}}
train: {{max_epochs: 3, batch_size: 32, log_every: 1}}
checkpoint: {{every_steps: 4, keep_last: 2}}
memory: {{every_steps: 5}}
logging:
  tensorboard: true
  mlflow: {{tracking_uri: "sqlite:///{db}", experiment: kills}}
  wandb: {{mode: offline}}
"""
NOT_SCALARS = {"kind", "step", "epoch", "wall_s", "time"}


def same(key: str, got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    """The tracker holds every row at its step. A kill during a save leaves it holding rows the
    resumed run computes again (not sent twice): results are the same, bitwise; measurements
    (throughput, memory) are the killed process's own, so for those only the steps must agree."""
    if key.endswith("_per_s") or key.startswith("memory/"):
        return [s for s, _ in got] == [s for s, _ in want]
    return got == want


def expected(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``<kind>/<key>`` → every (step, value) of ``metrics.jsonl``, in step order."""
    out = collections.defaultdict(list)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key not in NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{row.get('kind', 'train')}/{key}"].append((row["step"], float(value)))
    return {key: sorted(points) for key, points in out.items()}


def checkpoint_steps(run_dir: Path) -> set[int]:
    return {int(p.parent.name.split("-")[1]) for p in run_dir.glob("checkpoints/step-*/manifest.json")}


def env(tmp_path: Path) -> dict[str, str]:
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_API_KEY": "",
    }


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_every_tracker_holds_metrics_jsonl_after_sigkills_and_resumes(tmp_path, seed, monkeypatch):
    # W&B keeps its service's address in this process's environment once a test here used it:
    # the runs below must start their own service, as a user's would.
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    rng = random.Random(seed)
    (tmp_path / "cfg.yaml").write_text(CONFIG.format(db=tmp_path / "mlflow.db"))
    run_dir = tmp_path / "runs" / "run"
    args = ["train", "cfg.yaml", "--no-progress"]
    for kill in range(2):
        seen = checkpoint_steps(run_dir)
        proc = start_keel(*args, *(["--resume", "auto"] if kill else []), cwd=tmp_path, **env(tmp_path))
        deadline = time.monotonic() + 90
        while proc.poll() is None and not checkpoint_steps(run_dir) - seen and time.monotonic() < deadline:
            time.sleep(0.01)  # a checkpoint of this process's own is on disk
        time.sleep(rng.uniform(0.0, 0.4))
        if proc.poll() is not None:
            pytest.fail(f"the run ended before the kill (exit {proc.returncode}): {proc.communicate()[1][-2000:]}")
        proc.kill()
        proc.communicate()
    done = run_keel(*args, "--resume", "auto", cwd=tmp_path, **env(tmp_path))
    assert done.returncode == 0, done.stderr
    want = expected(run_dir)
    assert {"train/loss", "train/samples_per_s", "memory/rss_bytes", "val/val_loss"} <= set(want)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id").read_text()
    assert client.get_run(run_id).info.status == "FINISHED"
    for key, points in want.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert same(key, got, points), f"MLflow's {key} differs from metrics.jsonl"

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key, points in want.items():
        got = sorted((e.step, e.value) for e in events.Scalars(key))
        assert [s for s, _ in got] == [s for s, _ in points], f"TensorBoard's {key} steps differ"
        assert same(key, [(s, pytest.approx(v, rel=1e-6)) for s, v in got], points), key

    offline = Offline(run_dir)
    assert len(offline.files) == 3  # one per process, all of the same W&B run
    for key, points in want.items():
        assert same(key, sorted(offline.history(key)), points), f"W&B's {key} differs from metrics.jsonl"
