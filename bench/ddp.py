"""The Trainer under DDP against a hand-written DDP loop doing the same work, and a sharded FSDP2
checkpoint save against a rank-0 full save of the same state.

Not a test: it prints figures. ``python bench/ddp.py`` starts itself under
``torch.distributed.run --standalone --nproc-per-node 2`` (gloo, one thread per rank).

Step time: each round trains a fresh MLP 64→512→512→10 (AdamW, warmup/cosine schedule,
clipping at 1.0) for STEPS steps of the global batch 64 (32 per rank). Both contenders use the
same data path (``EpochLoader`` with the rank's share), DDP, and a finite check of the loss and
gradient norm every step:

- the hand loop all-reduces ``[loss, grad_norm]`` to check them and skips non-finite steps;
- the Trainer runs with its guard on (memory rows and the leak census off: the hand loop has none).

Timing runs from step 10 to the last (rank 0; the Trainer's from metrics.jsonl wall times), in
interleaved rounds whose order alternates. Goal: the median of per-round ratios ≤ 1.05.

Checkpoint: a 12-block MLP of 1024-wide layers (~12.6 M parameters, AdamW state included:
~150 MB) sharded by FSDP2 over the two ranks; ``save_sharded`` (each rank writes its own shards
through torch.distributed.checkpoint) against gathering the full state to rank 0
(``get_state_dict(full_state_dict=True, cpu_offload=True)``) and writing it with ``CheckpointStore.save``.

    python bench/ddp.py [--rounds 15] [--steps 200] [--save-rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import torchkeel as tk
from torchkeel.checkpoint import CheckpointStore
from torchkeel.checkpoint.sharded import save_sharded
from torchkeel.data.loader import EpochLoader

BATCH = 64
FIRST = 10
SETTINGS = [
    "guard.enabled=true",
    "memory.every_steps=0",
    "memory.leak_check=false",
    "checkpoint.enabled=false",
    "train.log_every=10",
    "train.clip_grad_norm=1.0",
    "schedule.warmup_steps=20",
    "optim.lr=1e-3",
    "data.num_workers=0",
    "device=cpu",
]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make_data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def hand_loop(data: TensorDataset, steps: int) -> float:
    """Seconds per step of a careful hand-written DDP loop (rank 0's clock)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = tk.build_scheduler(optimizer, warmup_steps=20, total_steps=steps)
    loader = EpochLoader(data, BATCH, seed=0, rank=dist.get_rank(), world_size=dist.get_world_size())
    loss_fn = nn.CrossEntropyLoss()
    start = 0.0
    for step, (inputs, targets) in enumerate(loader.epoch(0), 1):
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        checked = torch.stack([loss.detach(), norm]) / dist.get_world_size()
        dist.all_reduce(checked)
        if all(torch.isfinite(checked).tolist()):
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step == FIRST:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (steps - FIRST)


def trainer(data: TensorDataset, steps: int, out_dir: str) -> float:
    config = tk.load_config(None, [f"out_dir={out_dir}", "train.max_epochs=1", f"train.batch_size={BATCH}", *SETTINGS])
    summary = tk.Trainer(
        config, model=make_model(), train_data=data, val_data=None, overwrite=True, progress=False
    ).fit()
    assert summary["steps"] == steps, summary
    if dist.get_rank() != 0:
        return 0.0
    wall = {r["step"]: r["wall_s"] for r in tk.read_metrics(f"{out_dir}/run/metrics.jsonl") if r["kind"] == "train"}
    return (wall[steps] - wall[FIRST]) / (steps - FIRST)


def checkpoint_rounds(rounds: int, out_dir: str) -> tuple[list[float], list[float]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(12)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).sum().backward()
    optimizer.step()
    sharded_s, full_s = [], []
    store_sharded = CheckpointStore(f"{out_dir}/sharded", keep_last=1, save_top_k=0)
    store_full = CheckpointStore(f"{out_dir}/full", keep_last=1, save_top_k=0)
    for round_ in range(rounds):
        for kind in ["sharded", "full"] if round_ % 2 == 0 else ["full", "sharded"]:
            dist.barrier()
            start = time.perf_counter()
            if kind == "sharded":
                save_sharded(store_sharded, {"progress": {"step": round_}}, model, optimizer, step=round_ + 1, epoch=0)
            else:
                model_state, optim_state = get_state_dict(
                    model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
                )
                if dist.get_rank() == 0:
                    store_full.save({"model": model_state, "optimizer": optim_state}, step=round_ + 1, epoch=0)
                dist.barrier()
            (sharded_s if kind == "sharded" else full_s).append(time.perf_counter() - start)
    return sharded_s, full_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-rounds", type=int, default=5)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            os.path.abspath(__file__),
            *sys.argv[1:],
        ]
        os.execv(sys.executable, command)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = make_data(args.steps)
    hand, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = [tmp if rank == 0 else None]
        dist.broadcast_object_list(out_dir, src=0)  # the run directory rank 0 writes
        hand_loop(data, args.steps)  # warm-up
        trainer(data, args.steps, out_dir[0])
        for round_ in range(args.rounds):
            if round_ % 2 == 0:
                hand.append(hand_loop(data, args.steps))
                ours.append(trainer(data, args.steps, out_dir[0]))
            else:
                ours.append(trainer(data, args.steps, out_dir[0]))
                hand.append(hand_loop(data, args.steps))
        sharded, full = checkpoint_rounds(args.save_rounds, out_dir[0])
        dist.barrier()
    if rank == 0:
        print(
            f"2 ranks (gloo, 1 thread each), {args.rounds} rounds x {args.steps} steps, MLP 64-512-512-10, "
            f"global batch {BATCH}"
        )
        print(f"hand-written DDP loop  median step {statistics.median(hand) * 1e6:8.1f} us")
        print(f"Trainer under DDP      median step {statistics.median(ours) * 1e6:8.1f} us")
        ratio = statistics.median(o / h for o, h in zip(ours, hand))
        print(f"Trainer / hand loop    {ratio:.3f}   (goal <= 1.05)")
        print(
            f"checkpoint of ~150 MB state, {args.save_rounds} rounds: sharded (DCP, both ranks) median "
            f"{statistics.median(sharded):.3f} s, rank-0 full save median {statistics.median(full):.3f} s, "
            f"ratio {statistics.median(s / f for s, f in zip(sharded, full)):.3f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
