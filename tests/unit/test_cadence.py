"""When the Trainer checkpoints: bounded overhead, bounded lost work."""

from __future__ import annotations

import json

from torchkeel.train.cadence import SaveCadence


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_epoch_end_saves_wait_until_they_cost_at_most_max_overhead():
    clock = Clock()
    cadence = SaveCadence(every_s=0, max_overhead=0.02, clock=clock)
    assert cadence.is_due(at_epoch_end=True)  # the first epoch end measures the cost
    cadence.saved(0.010)
    saves, epochs = 1, 200
    for _ in range(epochs):
        clock.now += 0.005  # 5 ms epochs, 10 ms saves
        if cadence.is_due(at_epoch_end=True):
            cadence.saved(0.010)
            saves += 1
    training_s = epochs * 0.005
    assert saves * 0.010 <= 0.02 * training_s + 0.010  # one save's worth of rounding
    assert saves >= 2  # but it does save: every 0.5 s of training


def test_every_s_bounds_the_lost_work_between_epoch_ends():
    clock = Clock()
    cadence = SaveCadence(every_s=60, max_overhead=0.02, clock=clock)
    cadence.saved(0.5)
    clock.now += 59
    assert not cadence.is_due(at_epoch_end=False)
    clock.now += 1
    assert cadence.is_due(at_epoch_end=False)
    cadence.saved(5.0)  # a save that costs 5 s: 2 % allows one every 250 s, longer than every_s
    clock.now += 60
    assert not cadence.is_due(at_epoch_end=False)
    clock.now += 190
    assert cadence.is_due(at_epoch_end=False)
    assert not SaveCadence(every_s=0, clock=clock).is_due(at_epoch_end=False)


def test_a_run_of_tiny_epochs_is_not_checkpointed_every_epoch(tiny_config):
    import torchkeel as tk

    trainer = tk.Trainer(tiny_config("train.max_epochs=60", "train.log_every=100"), progress=False)
    saves = []
    original = trainer.store.save
    trainer.store.save = lambda state, **kw: saves.append(kw["step"]) or original(state, **kw)
    trainer.fit()
    steps_per_epoch = trainer.step // 60
    assert saves[0] == steps_per_epoch and saves[-1] == trainer.step  # first epoch end, and the end
    assert len(saves) < 20
    summary = json.loads((trainer.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert trainer.store.latest_valid()[0].step == trainer.step
