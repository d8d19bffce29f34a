from __future__ import annotations

import math

import pytest
import torch

import torchkeel as tk


@pytest.mark.parametrize(
    ("decay", "step", "expected"),
    [
        ("cosine", 0, 0.1 * 1 / 10),  # first warmup step
        ("cosine", 4, 0.1 * 5 / 10),
        ("cosine", 9, 0.1),  # last warmup step reaches the peak
        ("cosine", 10, 0.1),  # decay starts at the peak
        ("cosine", 55, 0.01 + 0.09 * 0.5),  # halfway through decay: the midpoint
        ("cosine", 100, 0.01),  # last step: min_lr
        ("cosine", 500, 0.01),  # past the end: stays at min_lr
        ("linear", 55, 0.1 - 0.09 * 0.5),
        ("linear", 100, 0.01),
        ("constant", 77, 0.1),
    ],
)
def test_lr_at_chosen_steps(decay, step, expected):
    got = tk.lr_at(step, lr=0.1, warmup_steps=10, total_steps=101, decay=decay, min_lr=0.01)
    assert got == pytest.approx(expected, abs=1e-12)


def test_cosine_quarter_point():
    got = tk.lr_at(25, lr=1.0, warmup_steps=0, total_steps=101, decay="cosine")
    assert got == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_scheduler_follows_lr_at_per_optimizer_step():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.2)
    sched = tk.build_scheduler(opt, warmup_steps=3, total_steps=12, decay="linear", min_lr=0.02)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [tk.lr_at(s, lr=0.2, warmup_steps=3, total_steps=12, decay="linear", min_lr=0.02) for s in range(12)]
    assert seen == pytest.approx(expected)
    assert seen[2] == pytest.approx(0.2) and seen[-1] == pytest.approx(0.02)
