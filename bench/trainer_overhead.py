"""Overhead of torchkeel.Trainer against the plain PyTorch loop doing the same work, and of the
guards against the Trainer without them.

Not a test: it prints figures. One process, one thread, interleaved rounds (the order rotates
each round so drift on a noisy machine hits every contender). Each round trains a fresh
MLP 64→256→256→10 for one epoch of STEPS steps at batch 64 on synthetic data, with clipping,
a warmup/cosine schedule and AdamW (weight decay 0 everywhere, the Trainer's default: the same
kernels in every contender), three ways:

- the hand-written loop;
- the Trainer with the guards off (no non-finite check, memory rows, leak census or OOM split),
  writing metrics.jsonl every 10 steps;
- the Trainer with its defaults: non-finite check every step, a rollback snapshot every 200
  steps, memory rows every 100 steps, the leak detector's cheap signal every 10 steps, OOM
  splitting armed;
- the Trainer with its defaults and a validation every 100 steps (2,048 samples);
- the same with a torchmetrics F1 on validation and TensorBoard logging on (the ecosystem).

Step time is measured from step 10 to the last (set-up and warm-up left out; the Trainer's from
its metrics.jsonl wall times), over many short rounds, because this machine's speed drifts by
several percent from one second to the next. Goals, as the median of per-round ratios (each
round's runs back to back, so drift cancels): Trainer (guards off) ≤ 1.03 × the hand loop;
guards on ≤ 1.02 × guards off; F1 + TensorBoard ≤ 1.03 × the same Trainer without them.

    python bench/trainer_overhead.py [--rounds 31] [--steps 300]
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
FIRST = 10  # timing starts after this step: set-up and the first steps' warm-up are left out
GUARDS_OFF = ["guard.enabled=false", "memory.every_steps=0", "memory.leak_check=false", "oom.auto_split=false"]
ECOSYSTEM = [
    "metrics=[{name: f1, target: 'torchmetrics.classification:MulticlassF1Score', args: {num_classes: 10}}]",
    "logging.tensorboard=true",
]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def make_data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def hand_loop(data: TensorDataset, steps: int, out_dir: str) -> float:
    """Seconds per step of the plain loop, from step FIRST to the last (set-up excluded)."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # the Trainer's optim defaults
    scheduler = tk.build_scheduler(optimizer, warmup_steps=20, total_steps=steps)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    loss_fn = nn.CrossEntropyLoss()
    start = 0.0
    for step, (inputs, targets) in enumerate(loader, 1):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 10 == 0:  # the Trainer reads the loss back every 10 steps too
            loss.item()
        if step == FIRST:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (steps - FIRST)


def trainer(data: TensorDataset, steps: int, out_dir: str, extra: list[str], val: TensorDataset | None = None) -> float:
    """Seconds per step of Trainer.fit from step FIRST to the last, from metrics.jsonl's wall times."""
    config = tk.load_config(
        None,
        [
            f"out_dir={out_dir}",
            "train.max_epochs=1",
            f"train.batch_size={BATCH}",
            "train.clip_grad_norm=1.0",
            "schedule.warmup_steps=20",
            "optim.lr=1e-3",
            "train.log_every=10",
            "checkpoint.enabled=false",
            *extra,
        ],
    )
    fit = tk.Trainer(config, model=make_model(), train_data=data, val_data=val, overwrite=True, progress=False)
    summary = fit.fit()
    assert summary["steps"] == steps
    wall = {r["step"]: r["wall_s"] for r in tk.read_metrics(f"{out_dir}/run/metrics.jsonl") if r["kind"] == "train"}
    return (wall[steps] - wall[FIRST]) / (steps - FIRST)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = make_data(args.steps)
    val = make_data(2048 // BATCH)
    contenders = {
        "hand-written loop": lambda d: hand_loop(data, args.steps, d),
        "Trainer, guards off": lambda d: trainer(data, args.steps, d, GUARDS_OFF),
        "Trainer, guards on": lambda d: trainer(data, args.steps, d, []),
        "Trainer, + validation": lambda d: trainer(data, args.steps, d, ["train.val_every=100"], val),
        "  + F1 + TensorBoard": lambda d: trainer(data, args.steps, d, ["train.val_every=100", *ECOSYSTEM], val),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    with tempfile.TemporaryDirectory() as out_dir:
        for run in contenders.values():  # warm-up
            run(out_dir)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                times[name].append(contenders[name](out_dir))
    print(f"rounds {args.rounds} x {args.steps} steps, MLP 64-256-256-10, batch {BATCH}, 1 thread")
    for name, values in times.items():
        print(f"{name:22s} median step {statistics.median(values) * 1e6:8.1f} us")

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    print(f"Trainer (guards off) / hand loop   {paired(names[1], names[0]):.3f}   (goal <= 1.03)")
    print(f"guards on / guards off             {paired(names[2], names[1]):.3f}   (goal <= 1.02)")
    print(f"Trainer (guards on) / hand loop    {paired(names[2], names[0]):.3f}")
    print(f"F1 + TensorBoard / without them    {paired(names[4], names[3]):.3f}   (goal <= 1.03)")


if __name__ == "__main__":
    main()
