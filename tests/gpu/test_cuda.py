"""CUDA paths, run where a GPU exists (CI has none: these are skipped cleanly there)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchkeel as tk
from torchkeel.checkpoint import capture_rng, restore_rng
from torchkeel.train.memory import MemoryMonitor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def test_fp16_step_uses_a_grad_scaler_and_reports_true_norms():
    precision = tk.make_precision("fp16", CUDA)
    assert isinstance(precision.scaler, torch.amp.GradScaler)
    torch.manual_seed(0)
    model = nn.Linear(16, 4).to(CUDA)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    group = [(torch.randn(8, 16), torch.randint(0, 4, (8,)))]
    result = tk.train_step(
        model,
        opt,
        group,
        nn.functional.cross_entropy,
        tk.StepSettings(
            params=list(model.parameters()), precision=precision, device=CUDA, clip_grad_norm_max=1.0, check_finite=True
        ),
    )
    assert result.status in ("ok", "overflow") and result.grad_norm_value is not None


def test_cuda_rng_round_trips():
    state = capture_rng()
    first = torch.rand(4, device=CUDA)
    restore_rng(state)
    assert torch.equal(torch.rand(4, device=CUDA), first)


def test_memory_monitor_reads_cuda_figures():
    keep = torch.empty(64 * 2**20, dtype=torch.uint8, device=CUDA)
    stats, _ = MemoryMonitor(CUDA).sample()
    assert stats.cuda_allocated_bytes >= keep.numel() and stats.cuda_reserved_bytes >= stats.cuda_allocated_bytes
    assert 0.0 <= stats.fragmentation < 1.0
