"""A state carried across batches under real torchrun (gloo, 127.0.0.1): each rank carries the
state of its own rows, so two ranks train as one process does, and a resume of two ranks
continues every rank's state bitwise."""

from __future__ import annotations

import json
import os

import pytest
import torch
from distrun import HERE, env, final, max_difference, train

from torchkeel.checkpoint import CheckpointStore, read_checkpoint

# tests/unit/test_carry.py's LSTM and batchified stream: 4 rows a batch, 20 steps an epoch.
CONFIG = """
name: run
out_dir: runs
seed: 0
device: cpu
model: {target: test_carry:TinyLM}
data: {target: test_carry:make_data, shuffle: false, num_workers: 0}
loss: {step_fn: test_carry:lm_step}
optim: {name: sgd, lr: 1.0}
schedule: {decay: constant}
train: {max_epochs: 2, batch_size: 4, log_every: 1, clip_grad_norm: null, carry: {enabled: true}}
checkpoint: {every_s: 0, every_steps: 1, keep_last: 100}
dist: {init_timeout_s: 120, timeout_s: 60}
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    directory = tmp_path_factory.mktemp("carry")
    (directory / "cfg.yaml").write_text(CONFIG)
    return directory


def run_ok(cwd, nproc, *args):
    path = os.pathsep.join([env()["PYTHONPATH"], str(HERE.parent / "unit")])
    result = train(cwd, nproc, *args, PYTHONPATH=path)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def val_loss(cwd, name):
    return json.loads((cwd / "runs" / name / "summary.json").read_text())["val_loss"]


def test_each_rank_carries_its_own_rows_and_resumes_them_bitwise(work):
    run_ok(work, 1, "name=one")
    run_ok(work, 2, "name=two")
    _, one = final(work, "one")
    found, two = final(work, "two")
    # The same global batches: each rank's state follows its two rows, so the math is one process's.
    assert max_difference(two, one) < 1e-5
    assert val_loss(work, "two") == pytest.approx(val_loss(work, "one"), abs=1e-5)
    saved = read_checkpoint(CheckpointStore(work / "runs" / "two" / "checkpoints").path_for(13))
    states = [rank["train"] for rank in saved.state["carry"]]
    assert len(states) == 2 and all(h.shape == (1, 2, 24) for h, _ in states)
    assert not torch.equal(states[0][0], states[1][0])  # two ranks, two streams

    run_ok(work, 2, "name=resumed", "--resume", str(saved.path))
    _, resumed = final(work, "resumed")
    assert all(torch.equal(resumed[k], two[k]) for k in two)
