"""Overhead of torchkeel.Trainer against the plain PyTorch loop doing the same work.

Not a test: it prints figures. One process, one thread, interleaved rounds (the order flips
each round so drift on a noisy machine hits both sides). Each round trains a fresh
MLP 64→256→256→10 for one epoch of STEPS steps at batch 64 on synthetic data, with clipping,
a warmup/cosine schedule and AdamW, both ways; the Trainer also writes metrics.jsonl every
10 steps as it does by default. Goal: Trainer step time ≤ 1.03 × the hand loop's, as the
median of per-round ratios (each round's pair ran back to back, so drift cancels).

    python bench/trainer_overhead.py [--rounds 11] [--steps 1000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchkeel as tk

BATCH = 64


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def make_data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def hand_loop(data: TensorDataset, steps: int) -> float:
    """Seconds per step of the plain loop."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = tk.build_scheduler(optimizer, warmup_steps=20, total_steps=steps)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for inputs, targets in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    loss.item()
    return (time.perf_counter() - start) / steps


def trainer(data: TensorDataset, steps: int, out_dir: str) -> float:
    """Seconds per step of Trainer.fit (run directory, config.yaml and summary.json included)."""
    config = tk.load_config(
        None,
        [f"out_dir={out_dir}", "train.max_epochs=1", f"train.batch_size={BATCH}", "train.clip_grad_norm=1.0",
         "schedule.warmup_steps=20", "optim.lr=1e-3", "train.log_every=10"],
    )
    fit = tk.Trainer(config, model=make_model(), train_data=data, val_data=None, overwrite=True, progress=False)
    start = time.perf_counter()
    summary = fit.fit()
    assert summary["steps"] == steps
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = make_data(args.steps)
    hand_times, trainer_times = [], []
    with tempfile.TemporaryDirectory() as out_dir:
        hand_loop(data, args.steps)  # warm-up, both sides
        trainer(data, args.steps, out_dir)
        for round_ in range(args.rounds):
            if round_ % 2 == 0:
                hand_times.append(hand_loop(data, args.steps))
                trainer_times.append(trainer(data, args.steps, out_dir))
            else:
                trainer_times.append(trainer(data, args.steps, out_dir))
                hand_times.append(hand_loop(data, args.steps))
    hand, keel = statistics.median(hand_times), statistics.median(trainer_times)
    per_round = statistics.median(t / h for t, h in zip(trainer_times, hand_times))
    print(f"rounds {args.rounds} x {args.steps} steps, MLP 64-256-256-10, batch {BATCH}, 1 thread")
    print(f"hand-written loop  median step {hand * 1e6:8.1f} us")
    print(f"torchkeel.Trainer  median step {keel * 1e6:8.1f} us")
    print(f"ratio of medians   {keel / hand:.3f}")
    print(f"ratio, paired      {per_round:.3f}   (median of per-round Trainer/hand ratios; goal <= 1.03)")


if __name__ == "__main__":
    main()
