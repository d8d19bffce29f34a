"""Checkpoint costs for a ~100 MB model (plus its AdamW state): what blocks the training loop,
and save/load time of torch.save versus the torchkeel format.

Not a test: it prints figures. Interleaved rounds in one process; the median of each is shown.
Goal: the loop's blocking time for an async save ≤ 0.25 × a sync save's.

    python bench/checkpoint.py [--rounds 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from torchkeel.checkpoint import AsyncSaver, CheckpointStore, capture_training_state, read_checkpoint


def make_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 2048))  # 25.2M params, 101 MB
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, 4096)).sum().backward()
    optimizer.step()  # creates the moments: the full state is ~3x the weights
    return model, optimizer


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_save(state: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # the same durability the torchkeel format gives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    model, optimizer = make_state()
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    times: dict[str, list[float]] = {k: [] for k in
                                     ("sync_block", "async_block", "async_total", "torch_save", "keel_save",
                                      "torch_load", "keel_load")}
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        store = CheckpointStore(root / "ckpt", keep_last=1, save_top_k=0)
        saver = AsyncSaver(store)
        step = 0
        for _ in range(args.rounds):
            step += 1
            times["sync_block"].append(timed(lambda: store.save(capture_training_state(model, optimizer), step=step, epoch=0)))
            step += 1
            start = time.perf_counter()
            times["async_block"].append(timed(lambda: saver.save(capture_training_state(model, optimizer), step=step, epoch=0)))
            saver.wait()
            times["async_total"].append(time.perf_counter() - start)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            times["torch_save"].append(timed(lambda: torch_save(state, root / "state.pt")))
            times["keel_save"].append(times["sync_block"][-1])
            times["torch_load"].append(timed(lambda: torch.load(root / "state.pt", weights_only=True)))
            times["keel_load"].append(timed(lambda: read_checkpoint(store.path_for(step))))
        total_mb = sum(f.stat().st_size for f in store.path_for(step).iterdir()) / 2**20
    finally:
        shutil.rmtree(root)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model weights {weights_mb:.0f} MB; full checkpoint (weights + AdamW state + RNG) {total_mb:.0f} MB; "
          f"{args.rounds} rounds, medians")
    print(f"loop blocked, sync save        {med['sync_block'] * 1e3:8.1f} ms")
    print(f"loop blocked, async save       {med['async_block'] * 1e3:8.1f} ms   (background write done after "
          f"{med['async_total'] * 1e3:.0f} ms)")
    print(f"async / sync blocking          {med['async_block'] / med['sync_block']:8.3f}   (goal <= 0.25)")
    print(f"save: torch.save+fsync {med['torch_save'] * 1e3:7.1f} ms | torchkeel {med['keel_save'] * 1e3:7.1f} ms "
          f"(sha256 manifest, atomic, fsynced) | ratio {med['keel_save'] / med['torch_save']:.2f}")
    print(f"load: torch.load(weights_only) {med['torch_load'] * 1e3:7.1f} ms | torchkeel {med['keel_load'] * 1e3:7.1f} ms "
          f"(every hash verified) | ratio {med['keel_load'] / med['torch_load']:.2f}")


if __name__ == "__main__":
    main()
