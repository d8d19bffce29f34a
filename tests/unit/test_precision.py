"""Clipping sees the true (unscaled) gradients; precision choices per device."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchkeel as tk
from torchkeel.errors import ConfigError

SCALE = 1024.0


class StandInScaler:
    """Behaves like GradScaler with a fixed scale (GradScaler itself needs CUDA for fp16)."""

    def __init__(self):
        self.calls = []

    def scale(self, loss):
        self.calls.append("scale")
        return loss * SCALE

    def unscale_(self, optimizer):
        self.calls.append("unscale_")
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(SCALE)

    def step(self, optimizer):
        self.calls.append("step")
        optimizer.step()

    def update(self):
        self.calls.append("update")


def one_step(precision, clip):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x, y = torch.randn(32, 8) * 10, torch.randint(0, 4, (32,))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    result = tk.train_step(
        model,
        opt,
        [(x, y)],
        nn.functional.cross_entropy,
        tk.StepSettings(
            params=list(model.parameters()), precision=precision, device=torch.device("cpu"), clip_grad_norm_max=clip
        ),
    )
    return model, result


def test_clipping_happens_after_unscale():
    reference, ref_result = one_step(tk.Precision(), clip=0.5)
    scaler = StandInScaler()
    scaled, result = one_step(tk.Precision(scaler=scaler), clip=0.5)
    assert scaler.calls == ["scale", "unscale_", "step", "update"]
    # The reported norm is of the true gradients, and it was above the clip threshold.
    torch.testing.assert_close(result.grad_norm, ref_result.grad_norm)
    assert ref_result.grad_norm > 0.5
    for a, b in zip(reference.parameters(), scaled.parameters()):
        torch.testing.assert_close(b, a)


def test_clipping_before_unscale_would_differ():
    """Clipping the scaled gradients leaves 1/SCALE of the update: the check above can fail."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    start = copy.deepcopy(model)
    x, y = torch.randn(32, 8) * 10, torch.randint(0, 4, (32,))
    (nn.functional.cross_entropy(model(x), y) * SCALE).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    for p in model.parameters():
        p.grad.div_(SCALE)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    reference, _ = one_step(tk.Precision(), clip=0.5)
    moved_wrong = (model.weight - start.weight).abs().max()
    moved_right = (reference.weight - start.weight).abs().max()
    assert moved_wrong < moved_right / 100


def test_bf16_autocast_on_cpu():
    precision = tk.make_precision("bf16", torch.device("cpu"))
    assert precision.scaler is None
    with precision.autocast():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    _, result = one_step(precision, clip=1.0)
    assert torch.isfinite(result.loss) and result.loss.dtype == torch.float32


def test_fp32_has_no_autocast_and_fp16_needs_cuda():
    with tk.make_precision("fp32", torch.device("cpu")).autocast():
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device.*use precision=bf16"):
        tk.make_precision("fp16", torch.device("cpu"))
