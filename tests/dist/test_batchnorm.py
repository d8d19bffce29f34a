"""BatchNorm under real torchrun (gloo, CPU): each rank's own statistics unless
``dist.sync_batchnorm``; synced, 2 ranks × 32 give the parameters and running statistics of
1 rank × 64, under DDP and FSDP2, and a checkpoint of one process resumes on two. The start
says once, in the ``dist`` row and one warning, when batch norms normalize per rank."""

from __future__ import annotations

import json
import shutil

import pytest
from distrun import final, max_difference, train, write_config

MODEL = "model.target=distmodels:batch_normed"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bn")
    write_config(directory)
    return directory


def run_ok(cwd, nproc, *args):
    result = train(cwd, nproc, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def rows(cwd, name):
    return [json.loads(line) for line in (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def dist_row(cwd, name):
    found = [r for r in rows(cwd, name) if r.get("kind") == "dist"]
    return found[-1] if found else None


@pytest.fixture(scope="module")
def one_rank(work):
    result = run_ok(work, 1, "name=one", MODEL, "checkpoint.every_steps=10", "checkpoint.keep_last=5")
    assert dist_row(work, "one") is None and "sync_batchnorm" not in result.stderr  # one process: nothing to say
    return final(work, "one")[1]


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])  # FSDP2: make test-slow
def test_synced_batch_norm_on_two_ranks_gives_the_parameters_of_one(work, one_rank, strategy):
    name = f"sync-{strategy}"
    result = run_ok(work, 2, f"name={name}", MODEL, f"dist.strategy={strategy}", "dist.sync_batchnorm=true")
    found, weights = final(work, name)
    assert found.step == 20
    assert "1.running_mean" in weights and "4.num_batches_tracked" in weights  # a BatchNorm's keys
    assert max_difference(weights, one_rank) < 1e-5  # weights and running statistics
    row = dist_row(work, name)
    assert row["batch_norm"] == "synced" and row["batch_norm_layers"] == 2
    assert "dist.sync_batchnorm" not in result.stderr


def test_per_rank_batch_norm_is_said_once_at_the_start_and_differs_from_one_rank(work, one_rank):
    result = run_ok(work, 2, "name=per-rank", MODEL)
    row = dist_row(work, "per-rank")
    assert row["batch_norm"] == "per_rank" and row["batch_norm_layers"] == 2
    assert result.stderr.count("set dist.sync_batchnorm: true") == 1  # rank 0, once
    assert max_difference(final(work, "per-rank")[1], one_rank) > 1e-3  # what the note is about
    plain = run_ok(work, 2, "name=plain", "train.max_steps=2", "checkpoint.enabled=false")
    assert "batch_norm" not in dist_row(work, "plain") and "sync_batchnorm" not in plain.stderr


@pytest.mark.slow  # 2 torchrun jobs; the default suite has the synced and per-rank runs
def test_a_checkpoint_of_plain_batch_norm_resumes_synced_on_two_ranks(work, one_rank):
    """One process's checkpoint of step 10 (``BatchNorm1d`` keys) loads into the synced layers."""
    shutil.copytree(work / "runs" / "one", work / "runs" / "one-to-two")
    shutil.rmtree(work / "runs" / "one-to-two" / "checkpoints" / "step-00000020")
    result = run_ok(work, 2, "name=one-to-two", MODEL, "dist.sync_batchnorm=true", "--resume", "auto")
    resumed = [r for r in rows(work, "one-to-two") if r.get("kind") == "resume"]
    assert resumed[-1]["step"] == 10, result.stderr[-2000:]
    found, weights = final(work, "one-to-two")
    assert found.step == 20
    assert max_difference(weights, one_rank) < 1e-5
