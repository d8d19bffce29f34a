"""A plain PyTorch training loop that uses torchkeel's components without the Trainer.

Seeding, reproducible data order, accumulation groups, mixed precision, clipping after unscale,
the warmup/decay schedule, the non-finite guard with its four answers (continue, skip, roll
back, fail), leak detection, how often clipping acts, validation and metrics logging: each is
one call. The tests run this loop and the Trainer on the same config and check that the losses
(and the share of steps clipped) are identical, and, on data with NaN rows, that both meet the
same incidents and end with the same weights.

    python examples/hand_written_loop.py
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchkeel as tk


def make_data(
    num_samples: int = 600, num_features: int = 32, num_classes: int = 4, seed: int = 1234, nan_rows: tuple = ()
):
    """Synthetic classification: class centres plus noise, from a fixed generator; (train, val).
    ``nan_rows``: training samples whose inputs are NaN (a step that meets one goes non-finite)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, num_features, generator=g) * 2
    labels = torch.randint(0, num_classes, (num_samples,), generator=g)
    inputs = centres[labels] + torch.randn(num_samples, num_features, generator=g)
    split = num_samples * 4 // 5
    inputs[list(nan_rows)] = float("nan")
    return TensorDataset(inputs[:split], labels[:split]), TensorDataset(inputs[split:], labels[split:])


@dataclass
class LoopRun:
    """What ``main`` returns: the loss of every applied step, the incidents, the model."""

    losses: list[float]
    incidents: list[dict[str, Any]] = field(default_factory=list)
    model: nn.Module | None = None


def make_model(num_features: int = 32, hidden: int = 64, num_classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(num_features, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, num_classes))


def main(
    *,
    max_epochs: int = 3,
    batch_size: int = 16,
    accumulate: int = 4,
    lr: float = 3e-3,
    warmup_steps: int = 4,
    clip: float = 1.0,
    precision: str = "fp32",
    seed: int = 0,
    on_nonfinite: str = "skip",
    snapshot_every: int = 200,
    nan_rows: tuple = (),
    metrics_path: str | Path | None = None,
) -> LoopRun:
    """Train; return the loss of every applied step and the incidents the guard met."""
    tk.seed_everything(seed)  # the Trainer's build order: seed, data, model, loss, optimizer
    train_set, val_set = make_data(nan_rows=nan_rows)
    model = make_model()
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)  # the Trainer's default
    device = torch.device("cpu")
    amp = tk.make_precision(precision, device)
    loader = tk.EpochLoader(train_set, batch_size, seed=seed)
    num_steps = tk.total_steps(len(loader), accumulate, max_epochs, None)
    scheduler = tk.build_scheduler(optimizer, warmup_steps=warmup_steps, total_steps=num_steps)
    metrics = tk.MetricsWriter(metrics_path) if metrics_path else None
    clips = tk.ClipRate(clip)  # how often clipping rescales; a warning if it is most of the first steps
    guard, leaks, waiting = tk.NonFiniteGuard(on_nonfinite), tk.LeakDetector(), tk.InputBoundDetector()
    rollback = tk.Rollback(tk.TrainingParts(model, optimizer, scheduler, amp.scaler), every=snapshot_every)
    rollback.take(0)  # the state a first rollback returns to

    run, step = LoopRun([], model=model), 0
    for epoch in range(max_epochs):
        batches = tk.TimedBatches(loader.epoch(epoch))  # time spent waiting for data
        waiting.start()
        for group in tk.iter_groups(batches, accumulate):
            for where, error in loader.bad.take_new():  # skipped, never replaced
                print(f"bad sample {where}: {error}", file=sys.stderr)
            if finding := waiting.observe(batches.take()):
                print(f"input-bound: {finding['wait_fraction']:.0%} of the time waiting for data", file=sys.stderr)
            group_samples = sum(len(targets) for _, targets in group)
            step_loss = torch.zeros(())
            for inputs, targets in group:
                with amp.autocast():
                    loss = loss_fn(model(inputs), targets)
                share = loss * (len(targets) / group_samples)  # mean over the whole group
                amp.backward(share)
                step_loss += share.detach().float()
            amp.unscale_(optimizer)  # clip the true gradients, not scaled ones
            grad_norm = tk.clip_grad_norm(list(model.parameters()), clip)
            loss_value, norm_value = torch.stack([step_loss, grad_norm]).tolist()  # one host sync
            step += 1
            action = guard.observe(math.isfinite(loss_value) and math.isfinite(norm_value), rollback.can_restore)
            if action is not tk.Action.CONTINUE:
                amp.skip(optimizer)  # NaN/Inf: leave weights and optimizer state untouched
                optimizer.zero_grad(set_to_none=True)
                run.incidents.append({"kind": "nonfinite", "step": step, "action": action.value})
                if action is tk.Action.ROLLBACK:  # back to the older good state, at a lower learning rate
                    to_step = rollback.restore(guard.lr_scale)
                    run.incidents.append({"kind": "rollback", "step": step, "to_step": to_step})
                elif action is tk.Action.FAIL:
                    raise tk.TrainingDiverged(f"training diverged at step {step}: {guard.num_skipped} non-finite steps")
                continue  # SKIPPED, and after a rollback: on to the next batch
            amp.step(optimizer)  # exactly one step per group
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            rollback.after_step(step)  # a snapshot every `snapshot_every` applied steps
            run.losses.append(loss_value)
            clips.add(step, norm_value)
            if warning := clips.early_warning(step, is_last=step == num_steps):
                print(f"warning: {warning.message}", file=sys.stderr)
            if finding := leaks.observe(step):
                print(f"memory grows by {finding['graph_nodes_per_step']:.1f} graph nodes per step", file=sys.stderr)
            if metrics:
                row = {"kind": "train", "step": step, "loss": loss_value, "grad_norm": norm_value}
                metrics.write({**row, "clip_frac": clips.window_frac()})
        val = tk.evaluate(model, tk.EpochLoader(val_set, batch_size, shuffle=False).epoch(0), loss_fn, device=device)
        if metrics:
            metrics.write({"kind": "val", "step": step, "epoch": epoch, **val})
    if metrics:
        metrics.close()
    return run


if __name__ == "__main__":
    losses = main(metrics_path=sys.argv[1] if len(sys.argv) > 1 else None).losses
    print(f"{len(losses)} steps, first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
