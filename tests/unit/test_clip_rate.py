"""How often clipping rescales: ``clip_frac`` in the training rows, one warning when it rescales
most of the first steps (with the median norm and the fix), and ``keel report`` showing it."""

from __future__ import annotations

import html
import statistics

import pytest
import torch

import torchkeel as tk
from torchkeel.cli.main import main
from torchkeel.report import build_report
from torchkeel.report.build import _clip_line
from torchkeel.train.clipping import EARLY_STEPS, ClipRate
from torchkeel.train.runlog import read_metrics


def norm(value: float, *, read: bool) -> float | torch.Tensor:
    """A step's gradient norm as the guard read it (``read``), or as the device tensor it stays."""
    return value if read else torch.tensor(value)


@pytest.mark.parametrize("read", [True, False])
def test_window_frac_counts_the_applied_steps_whose_norm_exceeded_the_clip(read):
    rate = ClipRate(1.0)
    for step, value in enumerate([0.5, 2.0, 3.0, 0.9], start=1):
        rate.add(step, norm(value, read=read))
    assert rate.window_frac() == 0.5
    rate.add(5, norm(1.5, read=read))
    rate.add(6, norm(float("inf"), read=read), applied=False)  # skipped: not rescaled, not counted
    assert rate.window_frac() == 1.0
    assert rate.window_frac() is None  # no step since the last row
    long = ClipRate(1.0)  # a window longer than the norms kept uncounted
    for step in range(1, 2501):
        long.add(step, norm(2.0 if step % 4 == 0 else 0.5, read=read))
    assert long.window_frac() == 0.25
    unclipped = ClipRate(None)
    unclipped.add(1, norm(5.0, read=read))
    assert unclipped.window_frac() is None and unclipped.early_warning(EARLY_STEPS) is None


@pytest.mark.parametrize("read", [True, False])
def test_the_warning_comes_once_at_the_judged_step_when_most_first_steps_clip(read):
    norms = [3.0 + (i % 5) * 0.1 for i in range(50)]
    norms[:10] = [0.5] * 10  # 40 of 50 above the clip
    rate = ClipRate(1.0, early_steps=50)
    warnings = []
    for step, value in enumerate(norms + [9.0] * 10, start=1):
        rate.add(step, norm(value, read=read))
        warnings.append(rate.early_warning(step))
    found = [(step, w) for step, w in enumerate(warnings, start=1) if w is not None]
    assert [step for step, _ in found] == [50]
    warning = found[0][1]
    assert (warning.num_clipped, warning.num_steps, warning.first_step) == (40, 50, 1)
    assert warning.median_grad_norm == pytest.approx(statistics.median(norms))
    assert "train.clip_grad_norm: null" in warning.message and f"{warning.median_grad_norm:.3g}" in warning.message

    few = ClipRate(1.0, early_steps=50)
    for step in range(1, 51):
        few.add(step, norm(3.0 if step <= 25 else 0.5, read=read))  # exactly half: not most
        assert few.early_warning(step) is None

    resumed = ClipRate(1.0, early_steps=50)  # a run resumed at step 30 judges the steps it saw
    for step in range(31, 51):
        resumed.add(step, norm(2.0, read=read))
    judged = resumed.early_warning(50)
    assert (judged.first_step, judged.num_steps) == (31, 20) and resumed.early_warning(51) is None


def test_a_run_shorter_than_the_judged_steps_is_judged_at_its_last():
    rate = ClipRate(1.0)
    for step in range(1, 6):
        rate.add(step, 2.0)
    assert rate.early_warning(4) is None
    assert rate.early_warning(5, is_last=True).num_steps == 5


def train_rows(trainer):
    return [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.parametrize("guard", ["true", "false"])
def test_clip_frac_is_the_share_of_each_log_windows_steps_whose_norm_exceeded_the_clip(tiny_config, guard):
    # Two runs of the same steps: one row a step tells which steps clipped; rows every 4 steps add them up.
    common = ("train.clip_grad_norm=0.3", "train.max_epochs=1", f"guard.enabled={guard}")
    every_step = tk.Trainer(tiny_config(*common, "train.log_every=1", "name=each"), progress=False)
    every_step.fit()
    rows = train_rows(every_step)
    clipped = [r["grad_norm"] > 0.3 for r in rows]
    assert [r["clip_frac"] for r in rows] == [float(c) for c in clipped]
    assert 0 < sum(clipped) < len(clipped)  # some steps clip, some do not

    windows = tk.Trainer(tiny_config(*common, "train.log_every=4", "name=windows"), progress=False)
    windows.fit()
    for row in train_rows(windows):
        step = row["step"]
        window = clipped[(step - 1) // 4 * 4 : step]
        assert row["clip_frac"] == pytest.approx(sum(window) / len(window))
        assert row["grad_norm"] == rows[step - 1]["grad_norm"]


def test_every_train_row_has_clip_frac_and_none_when_clipping_is_off(tiny_config):
    for clip in ("1.0", "null"):
        trainer = tk.Trainer(
            tiny_config(f"train.clip_grad_norm={clip}", "train.max_steps=3", f"name=clip-{clip}"), progress=False
        )
        trainer.fit()
        assert [("clip_frac" in r) for r in train_rows(trainer)] == [clip != "null"] * 3
        # keel report draws the clip across the gradient-norm chart, where there is one
        drawn = _clip_line(trainer.run_dir, [(1, 3.0), (3, 2.0)])
        assert drawn == ([("train.clip_grad_norm 1", [(1, 1.0), (3, 1.0)])] if clip != "null" else [])


def test_keel_train_warns_once_with_the_median_and_the_fix_and_keel_report_shows_it(tiny_config, capsys, tmp_path):
    # Plain SGD at a small learning rate: the gradient norm stays near 2.7, and the default clip of 1.0
    # rescales every step (as it did the mnist script's Adadelta, whose median norm was 3.8).
    slow = ("optim.name=sgd", "optim.lr=0.005", "train.max_epochs=4")  # 120 steps
    trainer = tk.Trainer(tiny_config(*slow), progress=False)
    trainer.fit()
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    (warning,) = [r for r in rows if r["kind"] == "clipping"]
    first = [r["grad_norm"] for r in rows if r["kind"] == "train"][:EARLY_STEPS]
    assert warning["step"] == EARLY_STEPS and warning["num_steps"] == EARLY_STEPS
    assert warning["num_clipped"] == sum(n > 1.0 for n in first) > EARLY_STEPS // 2
    assert warning["median_grad_norm"] == pytest.approx(statistics.median(first))
    assert "train.clip_grad_norm: null" in warning["message"]
    assert capsys.readouterr().err.count(warning["message"]) == 1  # said on the console, once

    report = build_report(trainer.run_dir, tmp_path / "report")
    assert report.warnings == [warning["message"]]
    assert html.escape(warning["message"]) in report.path.read_text()
    assert "clipping" in report.drawn["grad_norm"] and "clipping" in report.drawn["clip_frac"]
    assert main(["report", str(trainer.run_dir), "--out", str(tmp_path / "cli")]) == 0
    assert f"warning: {warning['message']}\n" in capsys.readouterr().out


def test_no_warning_when_few_of_the_first_steps_clip(tiny_config, capsys, tmp_path):
    trainer = tk.Trainer(tiny_config("train.max_epochs=4"), progress=False)  # the default clip of 1.0
    trainer.fit()
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    first = [r["grad_norm"] for r in rows if r["kind"] == "train"][:EARLY_STEPS]
    assert 0 < sum(n > 1.0 for n in first) < EARLY_STEPS // 2  # clipped a few early steps only
    assert [r for r in rows if r["kind"] == "clipping"] == []
    assert "clipping rescaled" not in capsys.readouterr().err
    assert build_report(trainer.run_dir, tmp_path / "report").warnings == []


def test_the_hand_written_loop_counts_clipping_as_the_trainer_does(tiny_config, tmp_path):
    import hand_written_loop
    from test_trainer import LOOP_SETTINGS

    path = tmp_path / "loop.jsonl"
    hand_written_loop.main(
        max_epochs=3, batch_size=16, accumulate=4, lr=3e-3, warmup_steps=4, clip=1.0, metrics_path=path
    )
    trainer = tk.Trainer(tiny_config(*LOOP_SETTINGS), progress=False)
    trainer.fit()
    loop = [r["clip_frac"] for r in read_metrics(path) if r["kind"] == "train"]
    assert loop == [r["clip_frac"] for r in train_rows(trainer)]
    assert 0 < sum(loop) < len(loop) == 24
