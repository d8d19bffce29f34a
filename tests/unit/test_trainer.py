"""The Trainer's loop: limits, validation cadence, run files, failure summary, and the hand-written loop."""

from __future__ import annotations

import json

import hand_written_loop
import pytest
import torch
import yaml
from torch import nn

import torchkeel as tk
from torchkeel.errors import ConfigError


def rows(run_dir, kind):
    return [r for r in tk.read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


LOOP_SETTINGS = (  # the hand-written loop's settings below, as the Trainer's config says them
    "train.max_epochs=3",
    "train.accumulate=4",
    "optim.lr=3e-3",
    "optim.weight_decay=0",
    "schedule.warmup_steps=4",
    "train.clip_grad_norm=1.0",
)


def test_hand_written_loop_and_trainer_give_identical_losses(tiny_config, tmp_path):
    expected = hand_written_loop.main(
        max_epochs=3, batch_size=16, accumulate=4, lr=3e-3, warmup_steps=4, clip=1.0
    ).losses
    config = tiny_config(*LOOP_SETTINGS)
    tk.Trainer(config, progress=False).fit()
    losses = [r["loss"] for r in rows(tmp_path / "runs" / "tiny", "train")]
    assert len(losses) == len(expected) == 24
    assert losses == expected


GUARD_RUNS = {
    "skips-then-escalates": ("skip", (10, 11, 12, 13, 14, 15, 16, 17)),
    "rolls-back": ("rollback", (3,)),
    "gives-up": ("rollback", (3, 200)),
}


@pytest.mark.parametrize("policy, nan_rows", GUARD_RUNS.values(), ids=GUARD_RUNS.keys())
def test_the_hand_written_loop_meets_the_trainers_incidents_and_ends_with_its_weights(
    tiny_config, tmp_path, policy, nan_rows
):
    """Data with NaN rows: the loop answers each of the guard's actions as the Trainer does."""
    settings = dict(max_epochs=3, batch_size=16, accumulate=4, lr=3e-3, warmup_steps=4, clip=1.0)
    try:
        loop = hand_written_loop.main(**settings, on_nonfinite=policy, snapshot_every=5, nan_rows=nan_rows)
        loop_error = None
    except tk.TrainingDiverged as exc:
        loop, loop_error = None, exc
    config = tiny_config(
        *LOOP_SETTINGS,
        f"guard.on_nonfinite={policy}",
        "guard.snapshot_every=5",
        f"data.args.nan_rows={list(nan_rows)}",
    )
    trainer = tk.Trainer(config, progress=False)
    if loop_error is not None:
        with pytest.raises(tk.TrainingDiverged):
            trainer.fit()
    else:
        assert trainer.fit()["status"] == "completed"
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "incidents.jsonl").read_text().splitlines()]
    met = [
        {
            "kind": r["kind"],
            "step": r["step"],
            **({"action": r["action"]} if "action" in r else {"to_step": r["to_step"]}),
        }
        for r in rows
        if r["kind"] in ("nonfinite", "rollback")
    ]
    if loop_error is not None:
        assert met[-1]["action"] == "fail" and f"at step {met[-1]['step']}:" in str(loop_error)
        return
    assert met == loop.incidents and {i["action"] for i in met if "action" in i} <= {"skipped", "rollback"}
    assert any(i["kind"] == "rollback" for i in met)
    weights = trainer.model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in loop.model.state_dict().items())


def test_hand_written_loop_bf16_matches_too(tiny_config, tmp_path):
    expected = hand_written_loop.main(max_epochs=1, precision="bf16").losses
    config = tiny_config(
        "train.max_epochs=1",
        "train.accumulate=4",
        "optim.weight_decay=0",
        "schedule.warmup_steps=4",
        "precision=bf16",
    )
    tk.Trainer(config, progress=False).fit()
    assert [r["loss"] for r in rows(tmp_path / "runs" / "tiny", "train")] == expected


def test_run_files_and_summary(tiny_config, tmp_path):
    summary = tk.Trainer(tiny_config("train.log_every=5"), progress=False).fit()
    run = tmp_path / "runs" / "tiny"
    assert summary == json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 60 and summary["epochs"] == 2
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and summary["val_loss"] > 0
    train = rows(run, "train")
    assert [r["step"] for r in train] == list(range(5, 61, 5))
    assert set(train[0]) == {
        *("kind", "step", "epoch", "loss", "lr", "grad_norm", "clip_frac", "samples", "samples_per_s", "wall_s")
    }
    assert [r["samples"] for r in train][:2] == [80, 160]
    assert [(r["step"], r["epoch"]) for r in rows(run, "val")] == [(30, 0), (60, 1)]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["log_every"] == 5 and saved["model"]["target"] == "hand_written_loop:make_model"


def test_max_steps_stops_mid_epoch_and_validates_at_the_end(tiny_config, tmp_path):
    summary = tk.Trainer(
        tiny_config("train.max_epochs=null", "train.max_steps=7", "train.val_every=3"), progress=False
    ).fit()
    assert summary["steps"] == 7 and summary["epochs"] == 0
    assert [r["step"] for r in rows(tmp_path / "runs" / "tiny", "val")] == [3, 6, 7]


def test_lr_rows_follow_the_schedule(tiny_config, tmp_path):
    tk.Trainer(
        tiny_config("schedule.warmup_steps=10", "schedule.decay=linear", "schedule.min_lr=1e-4"), progress=False
    ).fit()
    lrs = [r["lr"] for r in rows(tmp_path / "runs" / "tiny", "train")]
    expected = [tk.lr_at(s, lr=3e-3, warmup_steps=10, total_steps=60, decay="linear", min_lr=1e-4) for s in range(60)]
    assert lrs == pytest.approx(expected)


class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 5:
            raise RuntimeError("boom in forward")
        return self.linear(x)


def test_failure_writes_a_failed_summary(tiny_config, tmp_path):
    with pytest.raises(RuntimeError, match="boom in forward"):
        tk.Trainer(tiny_config(), model=Exploding(), progress=False).fit()
    summary = json.loads((tmp_path / "runs" / "tiny" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 4
    assert summary["error"] == "RuntimeError: boom in forward"


def test_second_run_with_the_same_name_is_refused(tiny_config):
    tk.Trainer(tiny_config("train.max_steps=1"), progress=False).fit()
    with pytest.raises(tk.RunDirError, match="already exists"):
        tk.Trainer(tiny_config("train.max_steps=1"), progress=False).fit()
    assert tk.Trainer(tiny_config("train.max_steps=2"), overwrite=True, progress=False).fit()["steps"] == 2


def test_objects_replace_import_paths(tmp_path):
    train_set, val_set = hand_written_loop.make_data()
    config = tk.load_config(None, [f"out_dir={tmp_path}", "train.max_steps=3"])
    model = nn.Linear(32, 4)
    summary = tk.Trainer(config, model=model, train_data=train_set, val_data=val_set, progress=False).fit()
    assert summary["steps"] == 3 and "val_accuracy" in summary


def test_progress_lines_without_a_tty(tiny_config, capsys):
    tk.Trainer(tiny_config("train.max_steps=4", "train.log_every=2"), progress=True).fit()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("keel: data.num_workers=auto: ")  # the worker trial's choice comes first
    assert err[1].startswith("step 2 epoch 0 loss ") and err[-1].startswith("validation: step 4")


def test_validation_features_of_another_width_are_refused_at_the_first_step(tmp_path):
    from torch.utils.data import TensorDataset

    from torchkeel.data.build import check_alike, first_sample

    config = tk.load_config(None, [f"out_dir={tmp_path}", "train.max_steps=3", "data.num_workers=0"])
    train = TensorDataset(torch.randn(64, 32), torch.randint(0, 4, (64,)))
    val = TensorDataset(torch.randn(16, 16), torch.randint(0, 4, (16,)))
    trainer = tk.Trainer(config, model=nn.Linear(32, 4), train_data=train, val_data=val, progress=False)
    with pytest.raises(ConfigError, match=r"sample\[0\] has shape \[16\] in the first validation sample, \[32\] per"):
        trainer.fit()
    assert trainer.counters.step == 0  # before the first step, not after an epoch
    ids = first_sample(TensorDataset(torch.randint(0, 9, (16, 7)), torch.randint(0, 4, (16,))))
    check_alike((torch.randint(0, 9, (8, 12)), torch.randint(0, 4, (8,))), ids)  # token ids: any length
    images = first_sample(TensorDataset(torch.randn(4, 8, 8)), transform=lambda s: (s[0][None],))
    check_alike((torch.randn(2, 1, 8, 8),), images)  # compared as the loader gives it: transformed
    with pytest.raises(ConfigError, match=r"sample\[0\] has shape \[1, 8, 8\] in the first validation sample"):
        check_alike((torch.randn(2, 1, 8, 6),), images)


def test_the_worker_choice_is_said_without_progress_output_too(tiny_config, capsys):
    tk.Trainer(tiny_config("train.max_steps=2", "data.num_workers=auto"), progress=False).fit()
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("keel: data.num_workers=auto: ")], err


def test_trainer_accumulation_matches_the_big_batch(tiny_config):
    """480 samples: batch 64 ends with a 32-sample step; 16 × 4 ends with a group of two."""
    weights = []
    for name, batch, accumulate in (("big", 64, 1), ("small", 16, 4)):
        config = tiny_config(
            f"name={name}",
            f"train.batch_size={batch}",
            f"train.accumulate={accumulate}",
            "train.clip_grad_norm=null",
            "model.target=torch.nn:Linear",
            "model.args={in_features: 32, out_features: 4}",
        )
        trainer = tk.Trainer(config, progress=False)
        assert trainer.fit()["steps"] == 16
        weights.append(trainer.model.state_dict())
    for key in weights[0]:
        torch.testing.assert_close(weights[1][key], weights[0][key], rtol=0, atol=1e-6)


@pytest.mark.parametrize("epochs", [2, 3])
def test_every_epoch_of_a_stream_is_trained_to_its_end_and_the_schedule_ends_at_its_floor(
    tmp_path, monkeypatch, epochs
):
    """3 shards of 150/130/120 samples in 2 streams, 2 workers, batch 32: epoch 0's plan has 13
    batches, epoch 1's 14; all of them are trained, and the last step runs at min_lr."""
    import streamdata

    log = tmp_path / "ids.log"
    monkeypatch.setenv("STREAM_LOG", str(log))
    config = tk.load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "model.target=streamdata:make_model",
            "data.format=webdataset",
            f"data.train={streamdata.write_shards(tmp_path / 'shards', sizes=(150, 130, 120))}",
            "data.input=npy",
            "data.target=cls",
            "data.streams=2",
            "data.num_workers=2",
            "loss.step_fn=streamdata:logged_step",
            "train.batch_size=32",
            f"train.max_epochs={epochs}",
            "train.log_every=1",
            "schedule.min_lr=1e-4",
            "optim.lr=1e-2",
            "schedule.warmup_steps=2",
        ],
    )
    trainer = tk.Trainer(config, progress=False)
    summary = trainer.fit()
    ids = [int(i) for i in log.read_text().split()]
    assert summary["samples"] == len(ids) == 400 * epochs and summary["epochs"] == epochs
    assert all(sorted(ids[e * 400 : (e + 1) * 400]) == list(range(400)) for e in range(epochs))
    per_epoch = [trainer.train_loader.num_batches(e) for e in range(epochs)]
    assert per_epoch[:2] == [13, 14]  # an epoch-0 estimate would cut epoch 1 short
    assert summary["steps"] == sum(per_epoch) == trainer.total_steps  # the plan counted every epoch exactly
    train = rows(tmp_path / "run", "train")
    assert train[-1]["step"] == summary["steps"] and train[-1]["lr"] == pytest.approx(1e-4, rel=1e-9)
    assert all(r["lr"] > 1e-4 * (1 + 1e-9) for r in train[:-1])


class LastBatchBad(torch.utils.data.Dataset):
    """64 samples in file order (batches of 8): the whole last batch fails to load."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= 56:
            raise OSError(f"sample {i} is unreadable")
        return torch.full((8,), i / 64.0), torch.tensor(i % 2)


def test_a_run_shorter_than_planned_takes_its_last_step_at_the_floor(tmp_path):
    """Bad samples removed a whole batch: 7 steps instead of the 8 planned. The loop reads one
    group ahead, knows the 7th is the last, and runs it at min_lr."""
    config = tk.load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "data.num_workers=0",
            "data.shuffle=false",
            "data.max_bad_fraction=0.2",
            "train.batch_size=8",
            "train.log_every=1",
            "schedule.min_lr=1e-4",
            "optim.lr=1e-2",
        ],
    )
    trainer = tk.Trainer(config, model=nn.Linear(8, 2), train_data=LastBatchBad(), progress=False)
    summary = trainer.fit()
    assert trainer.total_steps == 8 and summary["steps"] == 7 and summary["incidents"]["bad_sample"] == 8
    train = rows(tmp_path / "run", "train")
    assert train[-1]["lr"] == pytest.approx(1e-4, rel=1e-9) and train[-2]["lr"] > 2e-4


def test_the_job_line_is_not_a_progress_line():
    import io

    from torchkeel.train.runlog import Progress

    stream = io.StringIO()
    progress = Progress(10, stream=stream)
    progress.log({"kind": "dist", "step": 0, "world_size": 2, "strategy": "ddp"})
    progress.log({"kind": "resume", "step": 3, "checkpoint": "x"})
    assert stream.getvalue() == ""


def test_a_resumed_bar_counts_from_the_resumed_step():
    import io

    from torchkeel.train.runlog import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    progress = Progress(7500, stream=Terminal(), initial=5969)
    progress.advance(1531)
    assert progress.bar.n == 7500 and progress.bar.total == 7500
    progress.close()
