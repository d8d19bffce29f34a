"""SIGKILL a streaming run (Parquet, WebDataset; two persistent workers) mid-epoch and resume:
every epoch's samples are seen exactly once across the segments, each segment continues with
the very next samples, and the final weights equal the uninterrupted run's bit for bit."""

from __future__ import annotations

import random
import time

import pytest
import streamdata
from keelproc import run_keel
from test_resume import Run, assert_same_as_reference

CONFIG = """\
name: run
seed: 3
model: {{target: streamdata:make_model}}
data: {{format: {format}, train: "{train}", input: {input}, target: {target}, num_workers: 2, streams: 2}}
loss: {{step_fn: streamdata:logged_step}}
optim: {{lr: 3.0e-3}}
train: {{max_epochs: 2, batch_size: 16, accumulate: 1, log_every: 1}}
checkpoint: {{every_steps: 5, keep_last: 2}}
"""
FORMATS = {
    "parquet": lambda root: dict(
        format="parquet",
        train=streamdata.write_parquet(root),
        target="label",
        input="[id, " + ", ".join(f"f{j}" for j in range(streamdata.NUM_FEATURES)) + "]",
    ),
    "webdataset": lambda root: dict(
        format="webdataset", train=streamdata.write_shards(root), input="npy", target="cls"
    ),
}


class StreamRun(Run):
    def __init__(self, root, fmt: str) -> None:
        super().__init__(root, epochs=2)
        self.config.write_text(CONFIG.format(**FORMATS[fmt](root / "data")))
        self.log = root / "ids.log"
        self.env = {"STREAM_LOG": str(self.log)}
        self.total_steps = 2 * 30  # 480 samples in 2 streams, batches of 16, one batch a step: odd
        # checkpoints (every 5 steps) leave the second stream next, so a resume must serve it first


@pytest.fixture(scope="module")
def stream_references(tmp_path_factory):
    cache = {}

    def get(fmt: str):
        if fmt not in cache:
            run = StreamRun(tmp_path_factory.mktemp(f"ref-{fmt}"), fmt)
            result = run.run(resume=False, **run.env)
            assert result.returncode == 0, result.stderr
            ((position, ids),) = run.segment_indices()
            assert position == 0 and len(ids) == 2 * 480
            for epoch in range(2):  # exactly once per epoch, in an order that changes
                assert sorted(ids[epoch * 480 : (epoch + 1) * 480]) == list(range(480))
            assert ids[:480] != ids[480:]
            cache[fmt] = run.final_weights(), ids
        return cache[fmt]

    return get


def newest_step(run: StreamRun) -> int:
    """The step of the newest checkpoint directory (written or being written), 0 if none."""
    return max((step for step, _ in run.store.steps()), default=0)


@pytest.mark.slow  # the journeys and the worker-count test below kill streaming runs in the default suite
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_sigkill_mid_epoch_and_resume_auto(tmp_path, stream_references, fmt):
    reference = stream_references(fmt)
    run = StreamRun(tmp_path, fmt)
    rng = random.Random(fmt)
    resume, kills = False, 0
    while kills < 3:
        saved = newest_step(run)
        proc = run.start(resume=resume, STREAM_DELAY="0.01", **run.env)
        resume = True
        deadline = time.monotonic() + 60
        # The first segment lives past its first checkpoint, so that a resume starts mid-epoch
        # however slowly the process started; the later kills land anywhere after a step.
        while (
            (not run.stepped_since_resume() or (kills == 0 and newest_step(run) <= saved))
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.25))
        if proc.poll() is not None:
            break
        proc.kill()
        proc.communicate()
        kills += 1
    assert kills == 3
    final = run.run(resume=True, **run.env)
    assert final.returncode == 0, final.stderr
    assert len(run.segments) == 4
    positions = [p for p, _ in run.segments]
    assert any(p % 480 for p in positions[1:]), "no kill landed mid-epoch"
    assert_same_as_reference(run, reference)


def test_a_resume_with_another_worker_count_continues_bitwise(tmp_path, stream_references):
    """The batches do not depend on the number of workers: a kill, and a resume with 1 worker
    instead of 2, give the uninterrupted run's samples and weights."""
    reference = stream_references("parquet")
    run = StreamRun(tmp_path, "parquet")
    proc = run.start(resume=False, STREAM_DELAY="0.01", **run.env)
    deadline = time.monotonic() + 60
    while run.max_train_step() < 12 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.communicate()
    run.begin_segment()
    resumed = run_keel(*run.args(resume=True), "data.num_workers=1", cwd=run.root, **run.env)
    assert resumed.returncode == 0, resumed.stderr
    (_, first), (position, rest) = run.segment_indices()
    assert 0 < position < 480, "the kill did not land mid-epoch"
    epoch = first[:position] + rest[: 480 - position]
    assert sorted(epoch) == list(range(480)), "the rest of the epoch repeated or skipped samples"
    assert sorted(rest[480 - position :]) == list(range(480))  # the next epoch, whole
    assert "config differs from the checkpoint's: data.num_workers: 2 -> 1" in resumed.stderr
    assert_same_as_reference(run, reference)
