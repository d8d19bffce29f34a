"""The ports of examples/ports train as their READMEs say, on stand-ins for the originals' files.

The originals (nanoGPT's ``model.py``, pytorch/examples' ``mnist/main.py``) and their data are not
in the repository; each test writes a small file of the same shape — a ``GPT``/``GPTConfig`` whose
``forward(idx, targets)`` returns ``(logits, loss)``, a script with a ``Net`` and a torchvision
import at the top, MNIST-format idx files — and runs the port's config on them unchanged but for
the size. What is checked is what the port relies on: the learning rates of nanoGPT's ``get_lr``
and of ``StepLR`` per epoch, validation at step 0, no clipping.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
from keelproc import ROOT, run_keel

PORTS = ROOT / "examples" / "ports"

GPT_MODULE = """
from dataclasses import dataclass
import torch
from torch import nn
from torch.nn import functional as F

@dataclass
class GPTConfig:
    block_size: int = 8
    vocab_size: int = 65
    n_layer: int = 1
    n_head: int = 1
    n_embd: int = 8
    dropout: float = 0.0
    bias: bool = True

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        logits = self.head(self.norm(self.embed(idx)))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss
"""

MNIST_SCRIPT = """
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)
        self.dropout = nn.Dropout(0.25)

    def forward(self, x):
        return F.log_softmax(self.fc(self.dropout(torch.flatten(x, 1))), dim=1)

if __name__ == "__main__":
    raise SystemExit("the port never runs the script")
"""


def nanogpt_lr(it: int, lr=1e-3, warmup=100, decay_iters=500, min_lr=1e-4) -> float:
    """nanoGPT's ``get_lr`` with the port's settings."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = (min(it, decay_iters) - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def rows(run, kind):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_the_nanogpt_port_trains_with_nanogpts_rates(tmp_path):
    src = tmp_path / "nanogpt"
    (src / "data").mkdir(parents=True)
    (src / "model.py").write_text(GPT_MODULE)
    ids = np.random.default_rng(0).integers(0, 65, size=4000, dtype=np.uint16)
    ids[:3600].tofile(src / "data" / "train.bin")
    ids[3600:].tofile(src / "data" / "val.bin")
    port = PORTS / "nanogpt_char"
    result = run_keel(
        "train", str(port / "nanogpt_char.yaml"), "--no-progress",
        f"model.args.src={src}", f"data.args.data_dir={src / 'data'}",
        "model.args.n_layer=1", "model.args.n_head=1", "model.args.n_embd=8", "model.args.block_size=8",
        "data.args.block_size=8", "train.max_steps=120", "train.log_every=1", "val.max_batches=2",
        "schedule.decay_steps=120", f"out_dir={tmp_path / 'runs'}", "checkpoint.enabled=false",
        cwd=tmp_path, PYTHONPATH=str(port), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "nanogpt-char"
    train = rows(run, "train")
    assert [r["step"] for r in train] == list(range(1, 121))
    for r in train:  # step s (1-based) is nanoGPT's iteration s - 1
        assert math.isclose(r["lr"], nanogpt_lr(r["step"] - 1, decay_iters=120), rel_tol=1e-12)
    assert [r["step"] for r in rows(run, "val")] == [0, 120]  # val.at_start, and the end


def write_idx(path, array):
    path.write_bytes(struct.pack(f">I{array.ndim}I", 0x800 + array.ndim, *array.shape) + array.tobytes())


def test_the_mnist_port_trains_with_adadelta_and_steplr_per_epoch(tmp_path):
    (tmp_path / "main.py").write_text(MNIST_SCRIPT)
    rng = np.random.default_rng(0)
    for prefix, n in [("train", 96), ("t10k", 40)]:
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, size=n, dtype=np.uint8))
    port = PORTS / "mnist"
    result = run_keel(
        "train", str(port / "mnist.yaml"), "--no-progress",
        f"model.args.script={tmp_path / 'main.py'}", f"data.args.root={tmp_path}",
        "data.args.num_train=96", "data.args.num_test=32", "train.batch_size=32", "train.log_every=1",
        "train.max_epochs=3", f"out_dir={tmp_path / 'runs'}", "checkpoint.enabled=false",
        cwd=tmp_path, PYTHONPATH=str(port), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "mnist"
    train = rows(run, "train")
    assert [r["epoch"] for r in train] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(math.isclose(r["lr"], 0.7 ** r["epoch"]) for r in train)  # StepLR(step_size=1, gamma=0.7)
    assert all("clip_frac" not in r for r in train)  # train.clip_grad_norm: null: nothing clipped, as the script
    val = rows(run, "val")
    assert [r["step"] for r in val] == [3, 6, 9] and all(math.isfinite(r["val_loss"]) for r in val)
