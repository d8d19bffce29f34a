"""Kill ``keel train`` anywhere — at named points of a checkpoint write, by SIGTERM/SIGINT, at
random — and resume: the final weights equal an uninterrupted run's bit for bit, and every
segment trained on exactly the samples the uninterrupted run saw from that point."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from keelmain import keel_main  # noqa: F401 - a fixture
from keelproc import run_keel, start_keel

from torchkeel.checkpoint import CheckpointStore

CONFIG = """\
name: run
seed: 3
model: {{target: hand_written_loop:make_model}}
data: {{target: chaosdata:make_data, args: {{log_path: {log}, delay_s: {delay}}}, num_workers: 0}}
optim: {{lr: 3.0e-3}}
schedule: {{warmup_steps: 5}}
train: {{max_epochs: {epochs}, batch_size: 16, accumulate: 2, log_every: 1}}
checkpoint: {{every_steps: {every}, keep_last: 2}}
"""
STEPS_PER_EPOCH = 15  # 480 samples / 16 = 30 batches, 2 per step


class Run:
    """One run directory trained by one or more ``keel train`` processes."""

    def __init__(self, root: Path, delay: float = 0.0, every: int = 4, epochs: int = 3) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.log = root / "indices.log"
        self.config = root / "cfg.yaml"
        self.config.write_text(CONFIG.format(log=self.log, delay=delay, every=every, epochs=epochs))
        self.total_steps = epochs * STEPS_PER_EPOCH
        self.run_dir = root / "runs" / "run"
        self.store = CheckpointStore(self.run_dir / "checkpoints")
        self.segments: list[tuple[int, int]] = []  # (resumed sample position, log offset)

    def args(self, resume: bool) -> list[str]:
        return ["train", str(self.config), "--no-progress", *(["--resume", "auto"] if resume else [])]

    def begin_segment(self) -> None:
        if self.log.exists() and not self.log.read_bytes().endswith(b"\n"):
            with open(self.log, "ab") as f:  # a kill cut the last line: start the next one clean
                f.write(b"\n")
        found, _ = self.store.latest_valid()
        position = found.state["progress"]["samples"] if found else 0
        self.segments.append((position, self.log.stat().st_size if self.log.exists() else 0))

    def run(self, resume: bool, keel=run_keel, **env: str):
        """A ``keel train`` to its end: a subprocess, or ``keel=keel_main`` in this process (no kill
        or signal comes: a resume or an uninterrupted run needs no process of its own)."""
        self.begin_segment()
        return keel(*self.args(resume), cwd=self.root, **env)

    def start(self, resume: bool, **env: str):
        self.begin_segment()
        return start_keel(*self.args(resume), cwd=self.root, **env)

    def final_weights(self) -> dict[str, torch.Tensor]:
        found, problems = self.store.latest_valid()
        assert found is not None and found.step == self.total_steps, problems
        return found.state["model"]

    def segment_indices(self) -> list[tuple[int, list[int]]]:
        data = self.log.read_bytes()
        bounds = [offset for _, offset in self.segments] + [len(data)]
        result = []
        for (position, _), start, end in zip(self.segments, bounds, bounds[1:]):
            lines = data[start:end].split(b"\n")
            result.append((position, [int(x) for x in lines[:-1] if x]))  # the last piece may be cut
        return result

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # being written
        return rows

    def max_train_step(self) -> int:
        return max([0] + [r["step"] for r in self.rows() if r["kind"] == "train"])

    def stepped_since_resume(self) -> bool:
        """Whether the current process has finished a step (a train row after the last resume row)."""
        kinds = [r["kind"] for r in self.rows()]
        last_resume = max((i for i, k in enumerate(kinds) if k == "resume"), default=-1)
        return "train" in kinds[last_resume + 1 :]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted run's final weights and index log, per number of epochs."""
    cache = {}

    def get(keel_main, epochs: int = 3):
        if epochs not in cache:
            run = Run(tmp_path_factory.mktemp(f"reference{epochs}"), epochs=epochs)
            result = run.run(resume=False, keel=keel_main)
            assert result.returncode == 0, result.stderr
            ((position, indices),) = run.segment_indices()
            assert position == 0 and len(indices) == epochs * 480
            cache[epochs] = run.final_weights(), indices
        return cache[epochs]

    return get


@pytest.fixture
def reference(references, keel_main):
    return references(keel_main)


def assert_same_as_reference(run: Run, reference) -> None:
    weights, indices = reference
    final = run.final_weights()
    assert final.keys() == weights.keys()
    for key in weights:
        assert torch.equal(final[key], weights[key]), f"{key} differs from the uninterrupted run"
    for position, seen in run.segment_indices():
        assert seen == indices[position : position + len(seen)], "a segment repeated or skipped samples"


KILL_POINTS = [
    ("model.safetensors:before_temp", 8),
    ("model.safetensors:mid_write", 8),
    ("state.safetensors:after_write", 8),
    ("state.safetensors:after_fsync", 8),
    ("state.json:after_replace", 8),
    ("before_manifest", 8),
    ("after_manifest", 12),
]
# The default suite kills in the middle of the first file, after the last file and after the
# manifest; the other points are under `slow` (make test-slow).
DEFAULT_POINTS = ("model.safetensors:mid_write", "state.json:after_replace", "after_manifest")


@pytest.mark.parametrize(
    ("point", "newest_valid"),
    [
        pytest.param(point, newest, id=point, marks=() if point in DEFAULT_POINTS else pytest.mark.slow)
        for point, newest in KILL_POINTS
    ],
)
def test_kill_during_a_checkpoint_write(tmp_path, keel_main, reference, point, newest_valid):
    run = Run(tmp_path)
    killed = run.run(resume=False, TORCHKEEL_TEST_FAULTS=f"kill:{point}#3")  # the third save: step 12
    assert killed.returncode == -signal.SIGKILL
    found, problems = run.store.latest_valid()
    assert found is not None and found.step == newest_valid
    assert len(problems) == (0 if newest_valid == 12 else 1)
    resumed = run.run(resume=True, keel=keel_main)
    assert resumed.returncode == 0, resumed.stderr
    if newest_valid == 8:
        assert "skipping invalid checkpoint" in resumed.stderr and "step-00000012" in resumed.stderr
    assert_same_as_reference(run, reference)


@pytest.mark.parametrize(
    ("signum", "exit_code"),
    [
        (signal.SIGTERM, 143),
        # SIGINT takes the same path: in process in test_trainer_checkpoints, its exit code in test_cli
        pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow),
    ],
)
def test_preemption_saves_and_exits_with_128_plus_signal(tmp_path, keel_main, reference, signum, exit_code):
    run = Run(tmp_path, delay=0.002, every=100)
    proc = run.start(resume=False)
    deadline = time.monotonic() + 60
    while run.max_train_step() < 6 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == exit_code, stderr
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["signal"] == signal.Signals(signum).name
    found, _ = run.store.latest_valid()
    assert found.step == summary["steps"] and 6 <= found.step < run.total_steps
    resumed = run.run(resume=True, keel=keel_main)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run.run_dir / "summary.json").read_text())["status"] == "completed"
    assert_same_as_reference(run, reference)


def chaos(tmp_path, keel_main, reference, num_kills: int, seed: int, epochs: int = 3) -> None:
    """SIGKILL at random moments, every third kill while a checkpoint is being written."""
    rng = random.Random(seed)
    run = Run(tmp_path, delay=0.001, every=3, epochs=epochs)
    slow_writes = "sleep:model.safetensors:mid_write=0.05"  # makes the write window findable
    kills = during_write = 0
    resume = False
    while kills < num_kills:
        proc = run.start(resume=resume, TORCHKEEL_TEST_FAULTS=slow_writes)
        resume = True
        deadline = time.monotonic() + 60
        while not run.stepped_since_resume() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # wait until this process has trained a step
        want_write = kills % 3 == 0
        if want_write:  # a temporary file this process created: a write is under way
            stale = set(run.run_dir.glob("checkpoints/.step-*.tmp"))
            while proc.poll() is None and not set(run.run_dir.glob("checkpoints/.step-*.tmp")) - stale:
                time.sleep(0.002)
        else:
            time.sleep(rng.uniform(0.0, 0.15))
        if proc.poll() is not None:
            break  # finished before the kill: the run is too short for more kills
        proc.kill()
        proc.communicate()
        kills += 1
        during_write += want_write
    assert kills >= num_kills and during_write >= num_kills // 3
    final = run.run(resume=True, keel=keel_main, TORCHKEEL_TEST_FAULTS=slow_writes)
    assert final.returncode == 0, final.stderr
    assert_same_as_reference(run, reference)


def test_chaos_six_kills(tmp_path, keel_main, reference):  # 30 kills of longer runs under `slow`
    chaos(tmp_path, keel_main, reference, num_kills=6, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_chaos_long(tmp_path, keel_main, references, seed):
    chaos(tmp_path, keel_main, references(keel_main, 10), num_kills=30, seed=seed, epochs=10)
