"""The Trainer's components, each alone: counters, the run's files, checkpoints, protections,
bad-sample reports, and agreement through ``train_step``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import torchkeel as tk
from torchkeel.config.load import load_config
from torchkeel.data.bad import BadSampleLedger
from torchkeel.distributed import RankInfo, TrainingJob
from torchkeel.errors import TrainingDiverged
from torchkeel.train.checkpointing import RunCheckpoints, RunState
from torchkeel.train.counters import RunCounters, TrainingParts
from torchkeel.train.incidents import IncidentLog
from torchkeel.train.objective import Objective
from torchkeel.train.protect import BadSampleReport, Protections
from torchkeel.train.rundir import RunFiles
from torchkeel.train.runlog import Progress
from torchkeel.train.step import StepResult, StepSettings, train_step

CPU = torch.device("cpu")


def config(tmp_path, *overrides: str):
    base = {"name": "parts", "out_dir": str(tmp_path / "runs"), "train": {"max_steps": 10, "batch_size": 4}}
    return load_config(None, list(overrides), base=base)


def parts() -> TrainingParts:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = tk.build_scheduler(optimizer, warmup_steps=0, total_steps=10)
    return TrainingParts(model, optimizer, scheduler, None)


def result(status: str = "ok", loss: float = 1.0, **kw) -> StepResult:
    return StepResult(torch.tensor(loss), torch.tensor(1.0), 4, 1, status=status, loss_value=loss, **kw)


def test_counters_round_trip_and_a_counter_a_checkpoint_lacks_keeps_its_start_value():
    counters = RunCounters(step=7, epoch=1, batch_in_epoch=3, samples=28, val_metrics={"val_loss": 0.5})
    again = RunCounters()
    again.load_state_dict(counters.state_dict())
    assert again == counters
    partial = RunCounters()
    partial.load_state_dict({"step": 4, "data": {"ignored": True}})
    assert partial.step == 4 and partial.saved_at == -1 and partial.micro_batch_size is None


def test_run_files_are_written_by_rank_0_only_and_a_failed_run_says_why(tmp_path):
    written, silent = tmp_path / "runs" / "main", tmp_path / "runs" / "other"
    summaries = {}
    for run_dir, is_main in ((written, True), (silent, False)):
        files = RunFiles(run_dir, is_main=is_main, console=Progress(10, enabled=False))
        files.open(
            {"name": run_dir.name}, resume=False, resume_step=None, overwrite=False, logging=config(tmp_path).logging
        )
        files.log({"kind": "train", "step": 1, "loss": 0.5})
        files.incident("spike", 1, "loss above its average", quiet=True, loss=9.0)
        with pytest.raises(ValueError), files.ending(lambda: {"steps": 1}, lambda: {}) as summary:
            summary["status"] = "completed"
            raise ValueError("boom")
        summaries[is_main] = files.summary
        assert files.incidents.counts == {"spike": 1}  # every rank counts, whatever it writes
    assert not silent.exists()
    assert summaries[True] == summaries[False] == {"status": "failed", "error": "ValueError: boom", "steps": 1}
    assert json.loads((written / "summary.json").read_text())["status"] == "failed"
    assert [json.loads(line)["kind"] for line in (written / "incidents.jsonl").read_text().splitlines()] == ["spike"]
    assert "wall_s" in json.loads((written / "metrics.jsonl").read_text().splitlines()[0])


def test_a_resumed_run_files_drop_the_rows_a_killed_run_wrote_after_the_checkpoint(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    first = RunFiles(run_dir, is_main=True, console=Progress(10, enabled=False))
    first.open({}, resume=False, resume_step=None, overwrite=False, logging=config(tmp_path).logging)
    for step in (1, 2, 3, 4):
        first.log({"kind": "train", "step": step})
    first.close({"status": "failed"})
    resumed = RunFiles(run_dir, is_main=True, console=Progress(10, enabled=False))
    resumed.open({}, resume=True, resume_step=2, overwrite=False, logging=config(tmp_path).logging)
    assert [r["step"] for r in tk.read_metrics(run_dir / "metrics.jsonl")] == [1, 2]


def test_checkpoints_save_and_restore_the_learners_and_every_components_state(tmp_path):
    cfg = config(tmp_path)
    job = TrainingJob(cfg.dist, RankInfo(), CPU)
    a, b = parts(), parts()
    with torch.no_grad():
        a.model.weight.fill_(0.25)
    state = lambda p: RunState(
        RunCounters(),
        Protections.from_config(
            cfg,
            p,
            objective=Objective.of(nn.MSELoss()),  # noqa: E731
            precision=tk.Precision(),
            device=CPU,
            num_workers=0,
        ),
        BadSampleReport(job),
        IncidentLog(None),
        None,
        _Positions(),
    )
    saved, restored = state(a), state(b)
    saved.counters.step, saved.counters.epoch, saved.counters.val_metrics = 6, 1, {"val_loss": 0.25}
    saved.protections.guard.num_skipped = 2
    saved.bad_samples.shown.add("file.parquet row 3")
    saved.incidents.counts["bad_sample"] = 2
    checkpoints = RunCheckpoints(cfg.checkpoint, tmp_path / "ck", job)
    checkpoints.save(a, saved, read_ahead=0, meta={})
    checkpoints.wait()
    found = checkpoints.find("auto", warn=pytest.fail)
    assert found is not None and found.step == 6
    assert checkpoints.restore(found, b, restored, seed=0) is None  # one rank: RNG continues, nothing reseeded
    assert torch.equal(b.model.weight, a.model.weight)
    assert (restored.counters.step, restored.counters.epoch, restored.counters.val_metrics) == (
        6,
        1,
        {"val_loss": 0.25},
    )
    assert restored.protections.guard.num_skipped == 2 and restored.bad_samples.shown == {"file.parquet row 3"}
    assert restored.incidents.counts == {"bad_sample": 2} and restored.loader.loaded == {"position": 6}
    assert checkpoints.is_every_steps(6) is False  # checkpoint.every_steps is 0 by default: never


class _Positions:
    """A loader's position, as far as checkpoints see it."""

    def __init__(self) -> None:
        self.loaded = None

    def state_dict(self, read_ahead=0):
        return {"position": 6}

    def load_state_dict(self, state):
        self.loaded = state


def test_protections_name_what_acted_and_a_guard_that_gives_up_still_reports_its_step(tmp_path):
    cfg = config(
        tmp_path, "guard.on_nonfinite=rollback", "guard.max_rollbacks=1", "guard.diagnose=false", "guard.spike_factor=2"
    )
    p = parts()
    protections = Protections.from_config(
        cfg, p, objective=Objective.of(nn.MSELoss()), precision=tk.Precision(), device=CPU, num_workers=0
    )
    protections.take_snapshot(0)
    for step in range(1, 25):
        assert protections.after_step(result(loss=1.0), [], step, 0.0).incidents == []
    spike = protections.after_step(result(loss=50.0), [], 25, 0.0)
    assert [i.kind for i in spike.incidents] == ["spike"] and "50" in spike.incidents[0].message
    with torch.no_grad():
        p.model.weight.fill_(float("nan"))
    rolled = protections.after_step(result("nonfinite"), [], 26, 0.0)
    assert [i.kind for i in rolled.incidents] == ["nonfinite", "rollback"] and rolled.error is None
    assert torch.isfinite(p.model.weight).all()  # back to the snapshot of step 0
    gave_up = protections.after_step(result("nonfinite"), [], 27, 0.0)
    assert [i.kind for i in gave_up.incidents] == ["nonfinite"] and isinstance(gave_up.error, TrainingDiverged)
    split = protections.after_step(result(num_oom_splits=1, micro_batch_size=2), [], 28, 0.0)
    assert [i.kind for i in split.incidents] == ["oom_split"] and split.incidents[0].details["micro_batch_size"] == 2


def test_without_the_guard_no_snapshot_is_taken(tmp_path):
    protections = Protections.from_config(
        config(tmp_path, "guard.enabled=false"),
        parts(),
        objective=Objective.of(nn.MSELoss()),
        precision=tk.Precision(),
        device=CPU,
        num_workers=0,
    )
    protections.take_snapshot(0)
    assert protections.rollback is None


def test_a_bad_sample_is_printed_once_and_recorded_every_time(tmp_path):
    class Loader:
        bad = BadSampleLedger(max_fraction=1.0, num_samples=100)

    report = BadSampleReport(TrainingJob(config(tmp_path).dist, RankInfo(), CPU))
    seen = []
    for _ in range(2):
        Loader.bad.record([("a.parquet row 7", "null label")])
        seen += report.collect(Loader).incidents
    assert [(i.kind, i.quiet) for i in seen] == [("bad_sample", False), ("bad_sample", True)]
    assert Loader.bad.new == [] and report.state_dict() == ["a.parquet row 7"]


def test_train_step_agrees_on_flags_read_once_the_backward_is_done():
    model = nn.Linear(3, 1)
    signal = [False]
    model.register_forward_hook(lambda *args: signal.__setitem__(0, True))  # "arrives" during the step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(4, 3), torch.randn(4, 1))
    out = train_step(
        model,
        optimizer,
        [batch],
        nn.MSELoss(),
        StepSettings(
            params=list(model.parameters()), precision=tk.Precision(), device=CPU, agree=lambda: [signal[0], False]
        ),
    )
    assert out.agreed == [True, False]
    assert (
        train_step(
            model,
            optimizer,
            [batch],
            nn.MSELoss(),
            StepSettings(params=list(model.parameters()), precision=tk.Precision(), device=CPU),
        ).agreed
        == []
    )
