"""Distributed training under real torchrun (gloo, 127.0.0.1): the same math on 1 and 2 ranks,
resumes across world sizes, elastic restarts, preemption, stalled ranks and out-of-memory on one rank.

The data: 480 training samples, batches of 64 — the last batch of each epoch is short (32).
"""

from __future__ import annotations

import io
import json
import shutil
import signal
import socket
import subprocess
import tarfile
import time

import numpy as np
import pytest
import torch

from distrun import env, final, keel_command, max_difference, train, write_config
from torchkeel.data.order import unit_order

ADAMW = ("optim.name=adamw", "optim.lr=3e-3", "train.accumulate=2")
# Parameter groups by name (FSDP2's DTensors keep their names) and a scheduler by import path.
GROUPS = (
    "optim.name=adamw",
    "optim.weight_decay=0.1",
    "optim.decay_filter=matrices",
    "optim.groups=[{params: '2.*', lr: 1e-3}]",
    "schedule.target=torch.optim.lr_scheduler:StepLR",
    "schedule.args={step_size: 5, gamma: 0.5}",
)
CASES = {"sgd-accumulate-1": (), "adamw-accumulate-2": ADAMW, "adamw-groups": GROUPS}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dist")
    write_config(directory)
    return directory


def summary(cwd, name):
    return json.loads((cwd / "runs" / name / "summary.json").read_text())


def run_ok(cwd, nproc, *args, **kwargs):
    result = train(cwd, nproc, *args, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def one_rank(work):
    """The reference: each case trained in one process."""
    for case, args in CASES.items():
        run_ok(work, 1, f"name=one-{case}", "checkpoint.every_steps=5", "checkpoint.keep_last=10", *args)
    return {case: final(work, f"one-{case}") for case in CASES}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_parameters_and_metrics_of_one(work, one_rank, strategy, case):
    name = f"two-{strategy}-{case}"
    result = run_ok(work, 2, f"name={name}", f"dist.strategy={strategy}", *CASES[case])
    assert f"2 ranks, {strategy}, gloo: train.batch_size 64 is the job's batch, 32 samples per rank" in result.stderr
    assert "terminate called" not in result.stderr  # the process group is torn down before exit
    found, weights = final(work, name)
    reference, reference_weights = one_rank[case]
    assert found.step == reference.step == 20
    assert max_difference(weights, reference_weights) < 1e-5
    assert (found.shards is not None) == (strategy == "fsdp")  # FSDP: every rank wrote its own shards
    if strategy == "fsdp":
        assert sorted(p.name for p in found.shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # Validation was sharded and reduced: the whole set's metrics, as in one process.
    mine, theirs = summary(work, name), summary(work, f"one-{case}")
    for key in ("val_loss", "val_accuracy"):
        assert abs(mine[key] - theirs[key]) < 1e-6
    rows = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    reference_rows = [json.loads(line) for line in (work / "runs" / f"one-{case}" / "metrics.jsonl").read_text()
                      .splitlines() if json.loads(line).get("kind") == "train"]
    for mine, theirs in zip(train_rows, reference_rows, strict=True):  # the job's loss and norm, not rank 0's
        assert mine["samples"] == theirs["samples"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], abs=1e-5)


def _truncated_copy(work, source: str, target: str, keep_up_to: int) -> None:
    """A copy of run ``source`` as if it had stopped after the checkpoint of step ``keep_up_to``."""
    shutil.rmtree(work / "runs" / target, ignore_errors=True)
    shutil.copytree(work / "runs" / source, work / "runs" / target)
    for path in (work / "runs" / target / "checkpoints").iterdir():
        if path.name.startswith("step-") and int(path.name.split("-")[1]) > keep_up_to:
            shutil.rmtree(path)


@pytest.mark.parametrize("strategy,before,after", [
    ("fsdp", 2, 1),
    ("ddp", 1, 2),
    pytest.param("ddp", 2, 1, marks=pytest.mark.slow),
    pytest.param("fsdp", 1, 2, marks=pytest.mark.slow),
])
def test_a_checkpoint_of_n_ranks_resumes_on_m(work, one_rank, strategy, before, after):
    case = "adamw-accumulate-2"  # 4 steps an epoch: step 10 is mid-epoch 2
    source = f"src-{strategy}-{before}"
    run_ok(work, before, f"name={source}", f"dist.strategy={strategy}", "checkpoint.every_steps=5",
           "checkpoint.keep_last=10", *CASES[case])
    _truncated_copy(work, source, f"{source}-to-{after}", keep_up_to=10)
    result = run_ok(work, after, f"name={source}-to-{after}", f"dist.strategy={strategy}", "checkpoint.every_steps=5",
                    "checkpoint.keep_last=10", "--resume", "auto", *CASES[case])
    rows = [json.loads(line) for line in (work / "runs" / f"{source}-to-{after}" / "metrics.jsonl").read_text()
            .splitlines()]
    resumed = [r for r in rows if r.get("kind") == "resume"]
    assert resumed[-1]["step"] == 10 and resumed[-1]["batch_in_epoch"] == 4, result.stderr[-2000:]
    found, weights = final(work, f"{source}-to-{after}")
    reference, reference_weights = one_rank[case]
    assert found.step == 20
    # The same global batches in the same order, each sample once: the parameters of the uninterrupted run.
    assert max_difference(weights, reference_weights) < 1e-5
    assert summary(work, f"{source}-to-{after}")["val_loss"] == pytest.approx(
        summary(work, f"one-{case}")["val_loss"], abs=1e-6)


def test_elastic_restart_after_two_kills_ends_bitwise_equal(work):
    args = ("model.args.dropout=0.1", "checkpoint.every_steps=3", "train.max_steps=24", *ADAMW)
    run_ok(work, 2, "name=elastic-ref", *args)
    # Restart 0: rank 1 is killed before its 15th forward pass (step 8). Restart 1: rank 0 is
    # killed in the middle of writing the checkpoint of step 12. Restart 2 finishes.
    faults = {"TORCHKEEL_TEST_STEP_FAULTS": "kill:15@rank=1@restart=0",
              "TORCHKEEL_TEST_FAULTS": "kill:state.safetensors:mid_write#3@restart=1"}
    result = run_ok(work, 2, "name=elastic", "--resume", "auto", *args, max_restarts=3, **faults)
    rows = [json.loads(line) for line in (work / "runs" / "elastic" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "resume"] == [6, 9], result.stderr[-3000:]
    assert "step-00000012' is incomplete" in result.stderr  # the torn write was skipped, not loaded
    found, weights = final(work, "elastic")
    _, reference = final(work, "elastic-ref")
    assert found.step == 24
    assert all(torch.equal(weights[k], reference[k]) for k in reference)  # dropout masks continued on every rank


def test_sigterm_reaches_every_rank_which_saves_and_exits_143(work):
    args = ("name=term", "train.max_steps=400", "--nproc", "2")
    # Rank 0 pauses 2 s before its 12th forward pass, which makes the signal's arrival mid-run certain.
    process = subprocess.Popen(keel_command(1, *args), cwd=work, env=env(TORCHKEEL_TEST_STEP_FAULTS="sleep:12=2@rank=0"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = work / "runs" / "term" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and '"step": 5,' in metrics.read_text()):
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-3000:]
    assert "keel: rank 1: stopped by SIGTERM" in err and "(exit 143)" in err
    stopped = summary(work, "term")
    assert stopped["status"] == "preempted" and stopped["signal"] == "SIGTERM"
    found, _ = final(work, "term")
    assert found.step == stopped["steps"] < 400
    resumed = run_ok(work, 2, "name=term", f"train.max_steps={found.step + 4}",
                     "--resume", "auto")
    assert "status completed" in resumed.stdout
    assert final(work, "term")[0].step == found.step + 4


def test_the_rank_that_ended_first_is_named_with_its_machine_and_how_it_ended(work):
    host = socket.gethostname()
    killed = train(work, 2, "name=killed", timeout=120, TORCHKEEL_TEST_STEP_FAULTS="kill:6@rank=1")
    assert killed.returncode != 0
    line = next(line for line in killed.stderr.splitlines() if line.startswith("keel: error: rank 0:"))
    assert f"failed: rank 1 ({host}, pid " in line and "ended first without an error of its own: killed" in line, line
    assert summary(work, "killed")["error"].endswith(line.split("keel: error: ", 1)[1][-60:])
    failed = train(work, 2, "name=bug", "model.target=distmodels:FailsOnRank", timeout=120)
    assert failed.returncode != 0
    line = next(line for line in failed.stderr.splitlines() if line.startswith("keel: error: rank 0:"))
    assert f"failed: rank 1 on {host} ended first: ValueError: a user's bug on rank 1" in line, line
    assert "a user's bug on rank 1" in summary(work, "bug")["error"]  # summary.json holds the cause, not the echo


def _shard(path, rows, labels):
    with tarfile.open(path, "w") as tar:
        for i, (row, label) in enumerate(zip(rows, labels)):
            npy = io.BytesIO()
            np.save(npy, row)
            for name, payload in ((f"{i:06d}.npy", npy.getvalue()), (f"{i:06d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def test_the_rank_whose_data_ran_out_first_leaves_batchnorm_statistics_as_its_real_batches_left_them(work):
    """Two WebDataset shards, 64 and 192 rows: rank 0 reads the short one and runs out after 2 of
    the epoch's 6 steps. Its 4 stand-in forwards only serve DDP's collectives: the saved running
    mean (rank 0's, as DDP broadcasts it) is the mean of its 64 rows, over 2 tracked batches."""
    rng = np.random.default_rng(0)
    short = rng.normal(3.0, 1.0, size=(64, 32)).astype(np.float32)
    long = rng.normal(-2.0, 1.0, size=(192, 32)).astype(np.float32)
    first = unit_order(2, 3, 0, True)[0]  # the unit rank 0 is given first (the config's seed 3, epoch 0)
    for index, rows in ((first, short), (1 - first, long)):
        _shard(work / f"bn-{index:06d}.tar", rows, rng.integers(0, 4, len(rows)))
    _shard(work / "bn-val.tar", long[:32], [0] * 32)
    data = ("data.format=webdataset", "data.train=bn-{000000..000001}.tar",
            "data.val=bn-val.tar", "data.input=npy", "data.target=cls", "data.streams=1")
    result = train(work, 2, "name=bn", "model.target=distmodels:normalized", "train.max_steps=null",
                   "train.max_epochs=1", *data)
    assert result.returncode == 0, result.stderr[-3000:]
    found, weights = final(work, "bn")
    assert found.step == 6
    assert int(weights["0.num_batches_tracked"]) == 2
    assert torch.allclose(weights["0.running_mean"], torch.from_numpy(short.mean(0)), atol=1e-5)


def test_a_stalled_rank_fails_the_job_within_the_timeout_naming_it(work):
    start = time.monotonic()
    result = train(work, 2, "name=stall", "dist.timeout_s=3", timeout=120,
                   TORCHKEEL_TEST_STEP_FAULTS="sleep:6=20@rank=1")
    assert result.returncode != 0
    line = next(line for line in result.stderr.splitlines() if line.startswith("keel: error: rank 0:"))
    assert "at step 6 timed out after 3 s (dist.timeout_s): rank 1 did not arrive" in line, line
    assert time.monotonic() - start < 20 + 30  # the sleep would have taken 20 s; torchrun ends the job


def test_out_of_memory_on_one_rank_redoes_the_step_on_every_rank(work, one_rank):
    case = "adamw-accumulate-2"
    result = run_ok(work, 2, "name=oom", *CASES[case], TORCHKEEL_TEST_STEP_FAULTS="oom:8@rank=1")
    rows = [json.loads(line) for line in (work / "runs" / "oom" / "incidents.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["micro_batch_size"]) for r in rows] == [("oom_split", 1, 8)], result.stderr
    _, weights = final(work, "oom")
    assert max_difference(weights, one_rank[case][1]) < 1e-5  # the same result as without the fault


F1 = "metrics=[{name: f1, target: 'torchmetrics.classification:MulticlassF1Score', args: {num_classes: 4}}]"


def test_torchmetrics_over_two_ranks_count_each_sample_once(work):
    # 120 validation samples over 2 ranks of 32 per batch: the last global batch is short, and
    # rank 1's share of it is empty. torchmetrics' own sync must still see each sample once.
    for nproc in (1, 2):
        run_ok(work, nproc, f"name=f1-{nproc}", F1, "train.max_steps=6", "checkpoint.enabled=false")
    one, two = summary(work, "f1-1"), summary(work, "f1-2")
    assert 0 < one["val_f1"] <= 1 and "val_accuracy" not in one
    assert two["val_f1"] == pytest.approx(one["val_f1"], abs=1e-6)
    assert two["val_loss"] == pytest.approx(one["val_loss"], abs=1e-6)


def test_every_ranks_bad_samples_are_named_and_counted_for_the_job(work):
    bad = (3, 50, 100, 200, 300, 400)
    run_ok(work, 2, "name=bad", "data.target=distmodels:bad_data", f"data.args={{bad: {list(bad)}}}",
           "data.max_bad_fraction=0.02", "train.max_epochs=2", "train.max_steps=null")
    rows = [json.loads(line) for line in (work / "runs" / "bad" / "incidents.jsonl").read_text().splitlines()]
    met = [r for r in rows if r["kind"] == "bad_sample"]
    assert sorted(r["where"] for r in met) == sorted(f"dataset index {i}" for i in bad for _ in range(2))
    assert {r["rank"] for r in met} == {0, 1}  # rank 1's reach rank 0's file
    assert summary(work, "bad")["incidents"]["bad_sample"] == 12


def test_too_many_bad_samples_over_the_job_stop_every_rank_together(work):
    # 3 bad of 480 is over 0.005 of the epoch (2.4), while neither rank's own share is.
    result = train(work, 2, "name=too-bad", "data.target=distmodels:bad_data", "data.args={bad: [3, 50, 100]}",
                   "data.max_bad_fraction=0.005", "train.max_epochs=1", "train.max_steps=null", timeout=180)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("keel: error:")]
    assert errors and all("3 bad samples in epoch 0, more than data.max_bad_fraction=0.005 of 480 samples allows"
                          in line for line in errors), result.stderr[-3000:]
    assert summary(work, "too-bad")["status"] == "failed"
