"""Ray Train runs keel's Trainer in each worker of a TorchTrainer, on a local Ray cluster of two
CPU workers (127.0.0.1): the weights of one process, and a killed worker's run resumed from its
checkpoint through Ray's own failure handling."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[train]')")

from distrun import final, max_difference, write_config  # noqa: E402
from ray.exceptions import ActorDiedError  # noqa: E402
from ray.train import WorkerGroupError  # noqa: E402

from torchkeel.errors import ConfigError  # noqa: E402
from torchkeel.integrations.ray import RankFailed, RayJobFailed, ended_first, fit  # noqa: E402


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ray")
    write_config(directory)
    previous = os.getcwd()
    os.chdir(directory)  # the config's import paths and out_dir are relative to it, as for keel train
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}},
    )
    yield directory
    ray.shutdown()
    os.chdir(previous)


@pytest.fixture(scope="module")
def single(work):
    """The reference: the same run in one process, this one (``keel train``, one thread as Ray's workers)."""
    from torchkeel.cli.main import main

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setattr(sys, "path", list(sys.path))  # keel train puts its working directory on it
        torch.set_num_threads(1)
        try:
            assert main(["train", "cfg.yaml", "--no-progress", "name=single", "train.max_steps=24"]) == 0
        finally:
            torch.set_num_threads(threads)
    return final(work, "single")[1]


def test_two_ray_workers_train_the_weights_of_one_process(work, single):
    handler = signal.getsignal(signal.SIGINT)
    result = fit("cfg.yaml", ["name=on-ray", "train.max_steps=24"], num_workers=2)
    assert signal.getsignal(signal.SIGINT) is handler  # Ray's own handler does not outlive the fit
    assert result.error is None
    assert result.metrics["status"] == "completed" and result.metrics["steps"] == 24
    summary = json.loads((Path(result.checkpoint.path) / "summary.json").read_text())
    assert summary["run_dir"].endswith("on-ray")
    found, weights = final(work, "on-ray")
    assert found.step == 24
    assert max_difference(weights, single) < 1e-5


@pytest.mark.slow
def test_a_killed_worker_resumes_from_the_checkpoint_through_ray(work, single):
    # Rank 1 is SIGKILLed before its 9th forward pass, once (Ray counts no restarts: a marker file does).
    faults = {"TORCHKEEL_TEST_STEP_FAULTS": f"kill:9@rank=1@once={work / 'killed-once'}"}
    result = fit(
        "cfg.yaml",
        ["name=ray-killed", "train.max_steps=24", "checkpoint.every_steps=3"],
        num_workers=2,
        max_failures=2,
        worker_env=faults,
    )
    assert result.error is None and (work / "killed-once").exists()
    rows = (work / "runs" / "ray-killed" / "metrics.jsonl").read_text()
    assert '"kind": "resume"' in rows
    found, weights = final(work, "ray-killed")
    assert found.step == 24
    assert max_difference(weights, single) < 1e-5


@pytest.mark.slow  # a chaos variant: the default suite keeps the killed worker that Ray restarts and the unit test of which rank ended first
def test_a_worker_killed_under_ray_is_named_in_the_summary_with_its_machine(work):
    """Ray tears the group down when a worker dies: rank 0's summary.json names the rank that
    ended first and how, not the collective that failed after it."""
    with pytest.raises(RayJobFailed) as failed:
        fit(
            "cfg.yaml",
            ["name=ray-dies", "train.max_steps=24"],
            num_workers=2,
            max_failures=0,
            worker_env={"TORCHKEEL_TEST_STEP_FAULTS": "kill:6@rank=1"},
        )
    line = str(failed.value)
    assert (
        line.startswith(f"rank 1 ({socket.gethostname()}, pid ") and "ended first without an error of its own" in line
    )
    assert "its process died" in line, line
    summary = json.loads((work / "runs" / "ray-dies" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == line
    with pytest.raises(RayJobFailed, match=f"rank 1 on {socket.gethostname()} ended first: ValueError: a user's bug"):
        fit(
            "cfg.yaml",
            ["name=ray-bug", "train.max_steps=24", "model.target=distmodels:FailsOnRank"],
            num_workers=2,
            max_failures=0,
        )


GLOO_LOST_PEER = "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4747"


def test_the_rank_whose_process_died_ended_first_not_a_peer_whose_collective_broke_after():
    """Ray reports both: rank 1's worker that died (SIGKILL) and rank 0's error from the collective
    that lost rank 1, raised directly or as what failed while handling it (Ray destroys the group
    meanwhile). The rank that ended first is the cause; rank 0's error is a consequence."""
    try:
        try:
            raise RuntimeError(GLOO_LOST_PEER)
        except RuntimeError:
            raise ValueError("Default process group has not been initialized") from None
    except ValueError as error:
        while_handling = error
    assert while_handling.__context__ is not None
    for rank_0 in (RankFailed("vm", f"RuntimeError: {GLOO_LOST_PEER}"), RankFailed.of(while_handling)):
        line = ended_first(WorkerGroupError("Training failed", {0: rank_0, 1: ActorDiedError()}))
        assert line == (
            "rank 1 ended first without an error of its own: its process died "
            "(no detail from Ray: a signal, the out-of-memory killer or a crash)"
        ), line
    # Ray names only rank 0: its error followed another rank's end, and the line does not say it ended first.
    line = ended_first(WorkerGroupError("Training failed", {0: RankFailed.of(while_handling)}))
    assert line.startswith(f"rank 0 on {socket.gethostname()} failed after another rank went away: ValueError"), line


PARQUET_CONFIG = """
name: pq-ray
out_dir: runs
seed: 3
device: cpu
model: {{target: dyingmodels:DiesOnce, args: {{marker: {marker}, at: 5, rank: 1}}}}
data:
  format: parquet
  train: "data/pq/*.parquet"
  input: [id, f0, f1, f2, f3, f4, f5, f6, f7]
  target: label
  num_workers: 0
optim: {{name: sgd, lr: 0.05}}
train: {{max_epochs: null, max_steps: 10, batch_size: 32, log_every: 5}}
checkpoint: {{every_steps: 2, every_s: 0}}
dist: {{init_timeout_s: 120, timeout_s: 60}}
"""


def test_keel_train_ray_with_relative_data_paths_survives_a_killed_worker(work, capsys):
    """What every example config does (data paths relative to where keel train runs) and what a
    worker's death does: the CLI's default failure budget restarts the group, which resumes."""
    from streamdata import write_parquet

    from torchkeel.cli.main import main

    write_parquet(work / "data" / "pq")
    marker = work / "pq-killed-once"
    (work / "pq.yaml").write_text(PARQUET_CONFIG.format(marker=marker))
    assert main(["train", "pq.yaml", "--ray", "2", "--ray-storage", "ray-results"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("status completed") and "steps 10" in line and "pq-ray" in line
    assert marker.exists()  # rank 1 was killed at its 5th forward, and Ray restarted the group
    rows = [json.loads(r) for r in (work / "runs" / "pq-ray" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if r["kind"] == "resume"]) == 1
    assert any((work / "ray-results").iterdir())  # --ray-storage, relative to the working directory


def test_the_ray_failure_budget_is_checked_before_ray_starts():
    with pytest.raises(ConfigError, match="--max-failures must be >= -1"):
        fit("cfg.yaml", [], num_workers=2, max_failures=-2)
