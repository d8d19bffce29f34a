"""A schedule re-planned on resume (``--allow-config-change``: ``train.max_steps``, warmup, decay)
applies from the first resumed step, read from ``metrics.jsonl``'s ``lr`` (the rate that step
used), for every decay and for a run shortened, extended after it finished, or re-warmed."""

from __future__ import annotations

import json
import signal

import pytest
from test_trainer_checkpoints import SignalAt

import torchkeel as tk
from torchkeel.train.schedule import lr_at

LR = 3e-3


def lrs(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if r.get("kind") == "train"}


@pytest.mark.parametrize(
    ("decay", "first", "second"),
    [
        ("cosine", {"train.max_steps": 16}, {"train.max_steps": 12}),  # shortened at step 8
        ("linear", {"train.max_steps": 16}, {"train.max_steps": 12, "schedule.min_lr": 1e-4}),
        ("cosine", {"train.max_steps": 8}, {"train.max_steps": 12}),  # extended after it finished
        ("constant", {"train.max_steps": 16}, {"train.max_steps": 16, "schedule.warmup_steps": 12}),
        ("linear", {"train.max_steps": 16}, {"train.max_steps": 16, "schedule.decay": "cosine"}),
    ],
)
def test_the_first_resumed_step_uses_the_new_plans_rate(tiny_config, decay, first, second):
    base = ("train.max_epochs=null", f"optim.lr={LR}", "schedule.warmup_steps=2", f"schedule.decay={decay}")
    stop_at = SignalAt(8, signal.SIGTERM) if first["train.max_steps"] > 8 else SignalAt(0, signal.SIGTERM)
    begun = tk.Trainer(tiny_config(*base, *(f"{k}={v}" for k, v in first.items())), model=stop_at, progress=False)
    assert begun.fit()["status"] in ("preempted", "completed") and begun.step == 8
    plan = {"warmup_steps": 2, "decay": decay, "min_lr": 0.0, "total_steps": second["train.max_steps"]}
    plan.update({k.split(".")[1]: v for k, v in second.items() if k.startswith("schedule.")})
    resumed = tk.Trainer(
        tiny_config(*base, *(f"{k}={v}" for k, v in second.items())),
        model=SignalAt(0, signal.SIGTERM),
        resume="auto",
        allow_config_change=True,
        progress=False,
    )
    assert resumed.fit()["status"] == "completed"
    got = lrs(resumed.run_dir)
    for step in range(9, second["train.max_steps"] + 1):  # the rate of step s is the plan's at s - 1
        assert got[step] == pytest.approx(lr_at(step - 1, lr=LR, **plan), rel=1e-12, abs=1e-15), step
