"""Schedules as people write them: the built-in formulas against nanoGPT's and transformers'
(written out here, and transformers' own function), a scheduler class by import path stepped per
epoch or on a validation metric after a warmup, resumed exactly, and the config's refusals."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

import torchkeel as tk
from torchkeel.config.schema import ScheduleConfig
from torchkeel.train.hooks import TrainerHooks
from torchkeel.train.schedule import build_schedule, lr_at

LR = 3e-3
STEPS_PER_EPOCH = 30  # tiny_config: 480 training samples, batches of 16


def nanogpt_get_lr(it, *, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's train.py ``get_lr``, written out."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def transformers_cosine(step, *, num_warmup_steps, num_training_steps):
    """transformers' ``get_cosine_schedule_with_warmup`` factor (num_cycles 0.5), written out."""
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def rates(schedule, optimizer, steps):
    """The learning rate each optimizer step uses, stepping the schedule as train_step does."""
    used = []
    for _ in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return used


def sgd(lr=LR):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize("max_iters, warmup, decay_iters", [(60, 10, None), (60, 10, 40), (25, 0, None)])
def test_the_nanogpt_style_follows_nanogpts_get_lr_step_for_step(max_iters, warmup, decay_iters):
    # nanoGPT trains iterations 0..max_iters (max_iters + 1 steps) and decays to lr_decay_iters
    # (max_iters by default): the run's last step.
    optimizer = sgd()
    cfg = ScheduleConfig(warmup_steps=warmup, min_lr=LR / 10, style="nanogpt", decay_steps=decay_iters)
    schedule = build_schedule(cfg, optimizer, total_steps=max_iters + 1, peak_lr=LR)
    want = [
        nanogpt_get_lr(
            it, learning_rate=LR, warmup_iters=warmup, lr_decay_iters=decay_iters or max_iters, min_lr=LR / 10
        )
        for it in range(max_iters + 1)
    ]
    assert rates(schedule, optimizer, max_iters + 1) == pytest.approx(want, rel=1e-14, abs=0)


@pytest.mark.parametrize("total, warmup", [(50, 8), (12, 0), (7, 7)])
def test_the_transformers_style_is_get_cosine_schedule_with_warmup(total, warmup):
    optimizer = sgd()
    schedule = build_schedule(
        ScheduleConfig(warmup_steps=warmup, style="transformers"), optimizer, total_steps=total, peak_lr=LR
    )
    want = [LR * transformers_cosine(s, num_warmup_steps=warmup, num_training_steps=total) for s in range(total)]
    assert rates(schedule, optimizer, total) == want  # the same factor, the same bits


def test_the_transformers_style_equals_transformers_own_functions():
    optimization = pytest.importorskip("transformers.optimization")
    for decay, theirs in (
        ("cosine", optimization.get_cosine_schedule_with_warmup),
        ("linear", optimization.get_linear_schedule_with_warmup),
    ):
        ours_opt, their_opt = sgd(), sgd()
        ours = build_schedule(
            ScheduleConfig(warmup_steps=6, decay=decay, style="transformers"), ours_opt, total_steps=40, peak_lr=LR
        )
        reference = theirs(their_opt, num_warmup_steps=6, num_training_steps=40)
        assert rates(ours, ours_opt, 40) == rates(reference, their_opt, 40), decay


def test_the_default_style_is_unchanged():
    optimizer = sgd()
    schedule = build_schedule(ScheduleConfig(warmup_steps=3, min_lr=1e-4), optimizer, total_steps=20, peak_lr=LR)
    got = rates(schedule, optimizer, 20)
    assert got[:3] == pytest.approx([LR / 3, 2 * LR / 3, LR], rel=1e-15)
    assert got[-1] == pytest.approx(1e-4, rel=1e-12)  # the last step reaches min_lr


def metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["lr"] for r in rows if r.get("kind") == "train"}
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("kind") == "val"]
    return train, val


STEP_LR = ("schedule.target=torch.optim.lr_scheduler:StepLR", "schedule.args={step_size: 1, gamma: 0.7}")


def test_steplr_per_epoch_after_a_warmup(tiny_config):
    cfg = tiny_config(*STEP_LR, "schedule.interval=epoch", "schedule.warmup_steps=5", "train.max_epochs=3")
    trainer = tk.Trainer(cfg, progress=False)
    assert trainer.fit()["status"] == "completed"
    lrs, _ = metrics(trainer.run_dir)
    for step, lr in lrs.items():  # the rate step s (from 1) used
        epoch = (step - 1) // STEPS_PER_EPOCH
        want = LR * step / 5 if step <= 5 else LR * 0.7**epoch
        assert lr == pytest.approx(want, rel=1e-12), step


PLATEAU = (
    "schedule.target=torch.optim.lr_scheduler:ReduceLROnPlateau",
    "schedule.args={factor: 0.25, patience: 0}",
    "schedule.monitor=val_loss",
    "schedule.mode=max",  # the loss falls: every validation after the first is "worse", so the rate falls
)


def test_reduce_on_plateau_steps_after_each_validation_with_its_value(tiny_config):
    trainer = tk.Trainer(tiny_config(*PLATEAU, "train.max_epochs=4"), progress=False)
    assert trainer.fit()["status"] == "completed"
    lrs, vals = metrics(trainer.run_dir)
    reference_opt = sgd()
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(reference_opt, mode="max", factor=0.25, patience=0)
    pending = list(vals)
    for step in sorted(lrs):
        while pending and pending[0][0] < step:  # a validation after step v sets the rate of v + 1
            reference.step(pending.pop(0)[1])
        assert lrs[step] == reference_opt.param_groups[0]["lr"], step
    assert lrs[max(lrs)] < LR  # it did reduce


def stop_at(forward):
    """A hook that stops the run (SIGTERM) during training forward number ``forward``."""
    calls = [0]

    def hook(num_samples):
        calls[0] += 1
        if calls[0] == forward:
            os.kill(os.getpid(), signal.SIGTERM)

    return TrainerHooks(before_forward=hook)


@pytest.mark.parametrize(
    "settings, stop",
    [
        ((*STEP_LR, "schedule.interval=epoch", "schedule.warmup_steps=4"), STEPS_PER_EPOCH),  # at an epoch's end
        ((*STEP_LR, "schedule.interval=epoch"), 45),  # mid-epoch
        (PLATEAU, 45),  # mid-epoch, after a reduction's first validation
    ],
)
def test_a_stopped_and_resumed_run_equals_the_straight_one(tiny_config, settings, stop):
    straight = tk.Trainer(tiny_config("name=straight", "train.max_epochs=3", *settings), progress=False)
    straight.fit()
    stopped = tk.Trainer(tiny_config("train.max_epochs=3", *settings), hooks=stop_at(stop), progress=False)
    assert stopped.fit()["status"] == "preempted" and stopped.step == stop
    resumed = tk.Trainer(tiny_config("train.max_epochs=3", *settings), resume="auto", progress=False)
    assert resumed.fit()["status"] == "completed"
    assert metrics(resumed.run_dir) == metrics(straight.run_dir)
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("schedule.interval=epoch",), r"schedule.interval belongs to a schedule.target"),
        (("schedule.monitor=val_loss",), r"schedule.monitor belongs to a schedule.target"),
        ((*STEP_LR, "schedule.min_lr=1e-5"), r"schedule.min_lr shapes the built-in decay"),
        ((PLATEAU[0],), r"steps on a metric: set schedule.monitor"),
        ((*STEP_LR, "schedule.monitor=val_loss"), r"takes no metric in step\(\); remove schedule.monitor"),
        (("schedule.target=torch.optim.lr_scheduler:StepLR", "schedule.args={step_sise: 1}"), r"did you mean"),
        (("schedule.target=builtins:id",), r"must return a learning-rate"),
    ],
)
def test_a_schedule_that_cannot_run_is_one_config_error(tiny_config, overrides, message):
    with pytest.raises(tk.ConfigError, match=message) as caught:
        tk.Trainer(tiny_config(*overrides), progress=False)
    assert "\n" not in str(caught.value)


def test_a_monitor_the_validation_does_not_log_is_named(tiny_config):
    cfg = tiny_config(*PLATEAU[:2], "schedule.monitor=val_f1")
    with pytest.raises(tk.ConfigError, match=r"schedule.monitor='val_f1' is not a validation metric.*val_loss"):
        tk.Trainer(cfg, progress=False).fit()


def test_a_resume_refuses_new_arguments_for_a_target_schedule(tiny_config):
    first = tiny_config(*STEP_LR, "schedule.interval=epoch", "train.max_steps=10", "train.max_epochs=null")
    tk.Trainer(first, progress=False).fit()
    changed = tiny_config(
        "schedule.target=torch.optim.lr_scheduler:StepLR",
        "schedule.args={step_size: 1, gamma: 0.5}",
        "schedule.interval=epoch",
        "train.max_steps=20",
        "train.max_epochs=null",
    )
    with pytest.raises(tk.ConfigError, match=r"schedule.args.gamma differs .* restored from the checkpoint"):
        tk.Trainer(changed, resume="auto", allow_config_change=True, progress=False).fit()


def test_a_resume_replans_a_new_style_of_the_built_in_schedule(tiny_config):
    base = ("train.max_epochs=null", "train.max_steps=16", "schedule.warmup_steps=10")
    tk.Trainer(tiny_config(*base, "train.max_steps=6"), progress=False).fit()
    resumed = tk.Trainer(
        tiny_config(*base, "schedule.style=nanogpt"), resume="auto", allow_config_change=True, progress=False
    )
    assert resumed.fit()["status"] == "completed"
    lrs, _ = metrics(resumed.run_dir)
    for step in range(7, 17):  # step s (from 1) uses the new plan's rate of 0-based step s - 1
        want = lr_at(step - 1, lr=LR, warmup_steps=10, total_steps=16, style="nanogpt")
        assert lrs[step] == pytest.approx(want, rel=1e-12), step


def test_a_hand_loop_steps_a_target_schedule_as_the_plain_torch_loop_does():
    """mnist's loop: StepLR stepped at each epoch's end; the same rates from TargetSchedule."""
    plain_opt, ours_opt = sgd(1.0), sgd(1.0)
    plain = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=1, gamma=0.7)
    ours = tk.TargetSchedule(ours_opt, lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7), interval="epoch")
    for _ in range(4):
        for _ in range(5):
            assert ours_opt.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"]
            plain_opt.step()
            ours_opt.step()
            ours.step()
        plain.step()
        ours.epoch_ended()
    assert ours_opt.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"] == pytest.approx(0.7**4)


def test_a_rollback_scales_a_target_schedule_and_a_checkpoint_keeps_the_scale():
    from torchkeel.train.guards import apply_lr_scale

    def make(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    optimizer = sgd(1.0)
    schedule = tk.TargetSchedule(optimizer, make, warmup_steps=2)
    assert rates(schedule, optimizer, 3) == [0.5, 1.0, 1.0]  # warmup (s + 1) / 2, then StepLR from its first rate
    apply_lr_scale(schedule, optimizer, 0.25)
    assert optimizer.param_groups[0]["lr"] == 0.5 * 0.25
    saved = schedule.state_dict(), optimizer.state_dict()
    again_opt = sgd(1.0)
    again = tk.TargetSchedule(again_opt, make, warmup_steps=2)
    again.load_state_dict(saved[0])
    again_opt.load_state_dict(saved[1])
    assert rates(again, again_opt, 2) == rates(schedule, optimizer, 2) == [0.125, 0.0625]


PLATEAU_ON_TRAIN_LOSS = (
    "schedule.target=torch.optim.lr_scheduler:ReduceLROnPlateau",
    "schedule.args={factor: 0.25, patience: 0}",
    "schedule.monitor=train_loss",
    "schedule.mode=max",  # the loss falls: every epoch after the first is "worse", so the rate falls
)


def test_a_plateau_on_the_training_loss_steps_at_each_epochs_end_with_its_mean_loss():
    optimizer, reference_opt = sgd(), sgd()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    schedule = tk.TargetSchedule(optimizer, lambda o: plateau(o, patience=0), monitor="train_loss")
    reference = plateau(reference_opt, patience=0)
    for epoch_losses in ([3.0, 3.0, 3.0], [2.0, 1.0], [4.0, 6.0], [5.0]):
        for loss in epoch_losses:
            optimizer.step()
            schedule.step()
            schedule.add_train_loss(torch.tensor(loss))
            schedule.validated({"val_loss": 0.0})  # a validation does not step it
        schedule.epoch_ended()
        reference.step(sum(epoch_losses) / len(epoch_losses))
        assert optimizer.param_groups[0]["lr"] == reference_opt.param_groups[0]["lr"]
    assert optimizer.param_groups[0]["lr"] < LR  # means 3, 1.5, 5, 5: it did reduce


def test_the_trainer_steps_a_plateau_on_the_epochs_mean_training_loss(tiny_config):
    trainer = tk.Trainer(tiny_config(*PLATEAU_ON_TRAIN_LOSS, "train.max_epochs=4"), progress=False)
    assert trainer.fit()["status"] == "completed"
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert len(train) == 4 * STEPS_PER_EPOCH  # log_every 1: every step's loss and rate
    reference_opt = sgd()
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(reference_opt, mode="max", factor=0.25, patience=0)
    for epoch in range(4):
        rows_of_epoch = train[epoch * STEPS_PER_EPOCH : (epoch + 1) * STEPS_PER_EPOCH]
        assert {r["lr"] for r in rows_of_epoch} == {reference_opt.param_groups[0]["lr"]}, epoch
        reference.step(sum(r["loss"] for r in rows_of_epoch) / STEPS_PER_EPOCH)
    assert train[-1]["lr"] < LR


def test_a_plateau_on_the_training_loss_resumes_mid_epoch_exactly(tiny_config):
    test_a_stopped_and_resumed_run_equals_the_straight_one(tiny_config, PLATEAU_ON_TRAIN_LOSS, 45)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("schedule.monitor=loss",), r"schedule.monitor='loss' is not a metric .* train_loss"),
        (("schedule.monitor=train_accuracy",), r"schedule.monitor='train_accuracy' is not a metric"),
    ],
)
def test_a_monitor_no_schedule_can_get_is_refused_when_the_config_loads(tiny_config, overrides, message):
    with pytest.raises(tk.ConfigError, match=message) as caught:
        tiny_config(*PLATEAU[:2], *overrides).validate()
    assert "\n" not in str(caught.value)


def test_a_warning_of_the_model_shows_once_however_often_the_schedule_steps(tmp_path):
    """Python shows a warning once per place; stepping a schedule must not reset that record."""
    import subprocess
    import sys

    script = tmp_path / "warns.py"
    script.write_text(
        "import warnings, torch, torchkeel as tk\n"
        "from torchkeel.config import load_config\n"
        "class Model(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        warnings.warn('the model warns here')\n"
        "        return super().forward(x)\n"
        "def data():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x = torch.randn(64, 4, generator=g)\n"
        "    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())\n"
        f"cfg = load_config(None, ['out_dir={tmp_path}', 'train.batch_size=8', 'train.max_epochs=3',\n"
        "    'schedule.target=torch.optim.lr_scheduler:StepLR', 'schedule.args={step_size: 1}'])\n"
        "tk.Trainer(cfg, model=Model(4, 2), train_data=data(), progress=False).fit()\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "default", str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stderr.count("UserWarning: the model warns here") == 1, out.stderr[-2000:]
