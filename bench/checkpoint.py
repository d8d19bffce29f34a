"""Checkpoint costs for a ~100 MB model (plus its AdamW state): what blocks the training loop,
and save/load time of torch.save versus the torchkeel format.

Not a test: it prints figures. Interleaved rounds in one process, each timing from a settled disk (``os.sync()`` first);
the median of each is shown.
Goals: a sync save ≤ 1.1 × ``torch.save`` + fsync; a load with every byte verified (and every
tensor read, as ``torch.load`` reads them) ≤ 1.2 × ``torch.load(weights_only=True)``; peak RSS above
the process's baseline ≤ 1.25 × the state during a save and during a load; the loop's blocking
time for an async save ≤ 0.25 × a sync save's.

    python bench/checkpoint.py [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from torchkeel.checkpoint import AsyncSaver, CheckpointStore, capture_training_state, read_checkpoint, snapshot
from torchkeel.testing import peak_rss_during


def make_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 2048))  # 25.2M params, 101 MB
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, 4096)).sum().backward()
    optimizer.step()  # creates the moments: the full state is ~3x the weights
    return model, optimizer


def timed(fn) -> float:
    """Seconds ``fn`` takes, starting from a settled disk: every earlier write (and the deletion of
    pruned checkpoints) is flushed first, untimed, so that no measurement pays for another's."""
    time.sleep(0.2)  # let a background prune start its deletion
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def peak_rss_above(fn) -> int:
    """Peak RSS above the level before ``fn`` (after a collection), sampled every millisecond."""
    gc.collect()
    return peak_rss_during(fn)[0]


def keel_load(path: Path) -> None:
    """Read a checkpoint and every byte of its tensors, as torch.load does."""
    found = read_checkpoint(path)
    for value in found.state["model"].values():
        value.sum()
    for per_param in found.state["optimizer"]["state"].values():
        for value in per_param.values():
            value.sum()


def torch_load(path: Path) -> None:
    torch.load(path, weights_only=True)


def torch_save(state: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # the same durability the torchkeel format gives


def cadence(pairs: int) -> None:
    """``keel train``'s default checkpoints against none, on a run whose epochs take milliseconds:
    352 samples, batch 32 (11 steps an epoch), 100 epochs; interleaved pairs, median ratio."""
    import sys

    import torchkeel as tk

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    root = Path(tempfile.mkdtemp(prefix="torchkeel-bench-cadence-"))
    torch.set_num_threads(1)

    def run(enabled: bool) -> tuple[float, int]:
        config = tk.load_config(
            None,
            [
                f"out_dir={root}",
                "name=cadence",
                "model.target=hand_written_loop:make_model",
                "data.target=hand_written_loop:make_data",
                "data.args={num_samples: 440}",
                "train.batch_size=32",
                "train.max_epochs=100",
                "train.log_every=50",
                f"checkpoint.enabled={str(enabled).lower()}",
            ],
        )
        trainer = tk.Trainer(config, progress=False, overwrite=True)
        start = time.perf_counter()
        trainer.fit()
        elapsed = time.perf_counter() - start
        return elapsed, len(trainer.store.steps())

    try:
        run(True)  # warm-up
        ratios, saves = [], 0
        for i in range(pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            times = {}
            for enabled in order:
                times[enabled], count = run(enabled)
                saves = count if enabled else saves
            ratios.append(times[True] / times[False])
    finally:
        shutil.rmtree(root)
    print(
        f"cadence: 100 epochs x 11 steps, default checkpoints / none {statistics.median(ratios):.3f}   "
        f"(goal <= 1.1; {pairs} interleaved pairs, per-pair ratios {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"{saves} checkpoints kept on disk)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--cadence-pairs", type=int, default=5)
    args = parser.parse_args()
    cadence(args.cadence_pairs)
    model, optimizer = make_state()
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    times: dict[str, list[float]] = {
        k: []
        for k in ("sync_block", "async_block", "async_total", "torch_save", "keel_save", "torch_load", "keel_load")
    }
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        store = CheckpointStore(root / "ckpt", keep_last=1, save_top_k=0)
        saver = AsyncSaver(store)
        step = 0
        for _ in range(args.rounds):
            step += 1
            times["sync_block"].append(
                timed(lambda: store.save(capture_training_state(model, optimizer), step=step, epoch=0))
            )
            step += 1
            start = time.perf_counter()
            times["async_block"].append(
                timed(lambda: saver.save(capture_training_state(model, optimizer), step=step, epoch=0))
            )
            saver.wait()
            times["async_total"].append(time.perf_counter() - start)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            # A new file per save, the old one removed, as a training script's torch.save does (and as
            # the torchkeel store does): rewriting one file in place would skip block allocation.
            previous = sorted(root.glob("state-*.pt"))
            times["torch_save"].append(timed(lambda: torch_save(state, root / f"state-{step}.pt")))
            for old in previous:
                old.unlink()
            times["keel_save"].append(times["sync_block"][-1])
            times["torch_load"].append(timed(lambda: torch_load(root / f"state-{step}.pt")))
            times["keel_load"].append(timed(lambda: keel_load(store.path_for(step))))
        total_mb = sum(f.stat().st_size for f in store.path_for(step).iterdir()) / 2**20
        state_mb = sum(
            t.numel() * t.element_size() for t in snapshot(capture_training_state(model, optimizer))["model"].values()
        )
        state_mb = (
            state_mb
            + sum(
                v.numel() * v.element_size()
                for s in optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor)
            )
        ) / 2**20
        rss = {
            "sync save": peak_rss_above(
                lambda: store.save(capture_training_state(model, optimizer), step=step + 1, epoch=0)
            ),
            "async save": peak_rss_above(
                lambda: (saver.save(capture_training_state(model, optimizer), step=step + 2, epoch=0), saver.wait())
            ),
            "load": peak_rss_above(lambda: keel_load(store.path_for(step + 2))),
            "torch.save": peak_rss_above(lambda: torch_save(state, root / f"state-{step}.pt")),
            "torch.load": peak_rss_above(lambda: torch_load(root / f"state-{step}.pt")),
        }
    finally:
        shutil.rmtree(root)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"model weights {weights_mb:.0f} MB; full checkpoint (weights + AdamW state + RNG) {total_mb:.0f} MB; "
        f"{args.rounds} rounds, medians"
    )
    print(f"loop blocked, sync save        {med['sync_block'] * 1e3:8.1f} ms")
    print(
        f"loop blocked, async save       {med['async_block'] * 1e3:8.1f} ms   (background write done after "
        f"{med['async_total'] * 1e3:.0f} ms)"
    )
    print(f"async / sync blocking          {med['async_block'] / med['sync_block']:8.3f}   (goal <= 0.25)")
    print(
        f"save: torch.save+fsync {med['torch_save'] * 1e3:7.1f} ms | torchkeel {med['keel_save'] * 1e3:7.1f} ms "
        f"(xxh3-128 manifest, atomic, fsynced) | ratio {med['keel_save'] / med['torch_save']:.2f}   (goal <= 1.1)"
    )
    print(
        f"load: torch.load(weights_only) {med['torch_load'] * 1e3:7.1f} ms | torchkeel {med['keel_load'] * 1e3:7.1f} ms "
        f"(every byte hashed, every tensor read) | ratio {med['keel_load'] / med['torch_load']:.2f}   (goal <= 1.2)"
    )
    print(
        f"peak RSS above baseline, state {state_mb:.0f} MB: "
        + ", ".join(f"{name} {peak / 2**20:.0f} MB ({peak / 2**20 / state_mb:.2f}x)" for name, peak in rss.items())
        + "   (goal: torchkeel save and load <= 1.25x)"
    )


if __name__ == "__main__":
    main()
