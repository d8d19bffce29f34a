"""``keel train CONFIG [key=value ...]``: train what a YAML config describes."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import torch

from torchkeel.cluster.requeue import plan_requeue, requeue_job
from torchkeel.config.imports import check_target, resolve_target
from torchkeel.config.load import load_config
from torchkeel.config.schema import KeelConfig
from torchkeel.data.build import STREAMING_FORMATS, build_sources
from torchkeel.distributed.rank import RankInfo, per_rank
from torchkeel.env.cpus import choose_threads, usable_cpus
from torchkeel.errors import ConfigError, first_line
from torchkeel.integrations.command import command_trainer
from torchkeel.train.hf import check_hf_model
from torchkeel.train.preempt import PREEMPT_SIGNALS, WARNING_SIGNALS, preempt_exit_code
from torchkeel.train.rundir import check_run_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    parser.add_argument(
        "--resume", metavar="auto|PATH", help="continue from the newest valid checkpoint of the run (auto) or from PATH"
    )
    parser.add_argument(
        "--init-from",
        metavar="PATH",
        help="start from these weights (checkpoint, .safetensors, .pt); sets model.init_from",
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue although the config differs from the checkpoint's in what "
        "the run computes (data, model, batch, seed...)",
    )
    parser.add_argument(
        "--allow-data-change",
        action="store_true",
        help="with --resume: continue although data files (or the tokenizer's) changed, were added or "
        "removed since the checkpoint (a new data plan)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    parser.add_argument("--no-progress", action="store_true", help="print no progress lines")
    parser.add_argument(
        "--no-requeue",
        action="store_true",
        help="in a Slurm batch job stopped by SIGTERM or SIGUSR1, do not ask Slurm to requeue it (rank 0 does by default)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train on N processes of this machine: runs torch.distributed.run --standalone "
        "--nproc-per-node N with the same arguments (several machines: call torchrun)",
    )
    parser.add_argument(
        "--ray",
        type=int,
        metavar="N",
        help="train on N Ray Train workers (a local Ray cluster, or --ray-address); needs ray[train]",
    )
    parser.add_argument(
        "--ray-address", metavar="ADDR", help="with --ray: an existing Ray cluster (ray.init(address=))"
    )
    parser.add_argument(
        "--max-failures",
        type=int,
        default=3,
        metavar="N",
        help="with --ray: restart the worker group up to N times after a worker dies, each time "
        "resuming from the newest checkpoint (default 3; 0: fail at once; -1: without limit)",
    )
    parser.add_argument(
        "--ray-storage",
        metavar="PATH",
        help="with --ray: Ray Train's storage path (default: <run dir>/.ray; on several machines, shared storage)",
    )


def run(args: argparse.Namespace) -> int:
    # Console scripts do not put the working directory on sys.path; `python -m` would.
    # Users' import paths (model.target: mymodels:Net) are relative to where they run keel.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    overrides = list(args.overrides) + ([f"model.init_from={args.init_from}"] if args.init_from else [])
    config = load_config(args.config, overrides)  # a usage error is said once, before any rank starts
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        check_job(config, args.nproc, resume=bool(args.resume), overwrite=args.overwrite)
        return launch(args.nproc, args.argv)
    if args.ray is not None:
        check_job(config, args.ray, resume=True, overwrite=args.overwrite)
        return run_on_ray(args, overrides)
    rank = RankInfo.from_env()
    threads, reason = choose_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), usable_cpus(), os.environ)
    if threads is not None:
        torch.set_num_threads(threads)
    trainer = command_trainer(
        config,
        resume=args.resume,
        allow_config_change=args.allow_config_change,
        allow_data_change=args.allow_data_change,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    if threads is not None and rank.is_main and not args.no_progress:
        print(f"keel: torch threads: {threads} per process ({reason})", file=sys.stderr)
    summary = trainer.fit()
    if trainer.rank.is_main:
        print(format_summary(summary))
    elif summary["status"] == "preempted":
        print(
            f"keel: rank {trainer.rank.rank}: stopped by {summary['signal']} at step {summary['steps']} "
            f"(exit {exit_code(summary)})",
            file=sys.stderr,
        )
    if summary["status"] == "preempted":
        ask_requeue(summary, trainer.rank.is_main, enabled=not args.no_requeue)
    return exit_code(summary)


def ask_requeue(summary: dict, is_main: bool, *, enabled: bool) -> None:
    """Rank 0 of a Slurm batch job stopped by SIGTERM/SIGUSR1 asks Slurm to requeue it, once the
    checkpoint is saved; the exit code stays 128 + the signal either way."""
    plan = plan_requeue(summary["signal"], is_main=is_main, environ=os.environ, enabled=enabled)
    if plan.job_id is None:
        return
    failure = requeue_job(plan.job_id)
    if failure is None:
        print(
            f"keel: asked Slurm to requeue job {plan.job_id}; it resumes from step {summary['steps']}", file=sys.stderr
        )
    else:
        print(
            f"keel: could not requeue Slurm job {plan.job_id}: {failure}; it ends FAILED (exit {exit_code(summary)}): "
            "resubmit it to resume from its checkpoint",
            file=sys.stderr,
        )


def run_on_ray(args: argparse.Namespace, overrides: list[str]) -> int:
    """``keel train --ray N``: the run on N Ray Train workers; the summary line from rank 0's run."""
    from torchkeel.integrations.ray import fit

    if args.resume not in (None, "auto"):
        raise ConfigError("--ray resumes with --resume auto only (every worker restart does)")
    result = fit(
        args.config,
        overrides,
        num_workers=args.ray,
        address=args.ray_address,
        max_failures=args.max_failures,
        storage_path=args.ray_storage,
    )
    if result.error is not None:
        print(f"keel: error: the Ray run failed: {first_line(result.error)}", file=sys.stderr)
        return 1
    summary = result.metrics or {}
    print(format_summary(summary) if "wall_s" in summary else f"status {summary.get('status', 'unknown')}")
    return exit_code(summary) if "status" in summary else 1


def check_job(config: KeelConfig, world_size: int, *, resume: bool = True, overwrite: bool = False) -> None:
    """What every rank of a job of ``world_size`` would refuse, checked once before any starts:
    import paths, data files and columns, the batch's split over the ranks and the run directory
    (``resume``: an existing one is continued, as every restart of a job does)."""
    if world_size < 1:
        raise ConfigError(f"--nproc/--ray must be >= 1, got {world_size}")
    per_rank(config.train.batch_size, world_size)
    check_run_dir(config.out_dir, config.name, resume=resume, overwrite=overwrite)
    check_import_paths(config)


def check_import_paths(config: KeelConfig) -> None:
    """Every ``module:callable`` of the config resolves, checked once before the ranks start
    (each rank would otherwise print the same error, and torchrun its traceback)."""
    if config.model.target is not None:
        check_target(config.model.target, config.model.args, "model")
    if config.model.hf is not None:
        check_hf_model(config.model.hf)
    if config.data.format == "map" and config.data.target is not None:
        check_target(config.data.target, config.data.args, "data")
    if config.loss.step_fn is None:
        check_target(config.loss.target, config.loss.args, "loss")
    paths = [
        ("loss.step_fn", config.loss.step_fn),
        ("data.collate", config.data.collate if ":" in config.data.collate else None),
        ("data.transform", config.data.transform),
        ("data.batch_transform", config.data.batch_transform),
        *((f"metrics[{i}].target", m.target) for i, m in enumerate(config.metrics)),
    ]
    for key, target in paths:
        if target is not None:
            resolve_target(target, key)
    if config.data.format in STREAMING_FORMATS:
        build_sources(config.data)  # files, columns and shards as each rank would read them


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``torch.distributed.run --standalone --nproc-per-node N`` on the same command and wait.

    SIGTERM and SIGINT are passed on to torchrun (which passes them to every worker), and a
    scheduler's SIGUSR1 as SIGTERM; the exit code is torchrun's, except that a job stopped by a
    signal exits as one process would (128 + its number; 143 for SIGUSR1), where torchrun reports 1.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "torchkeel.cli.main",
        *rest,
    ]
    child = subprocess.Popen(command)
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        child.send_signal(signal.SIGTERM if signum in WARNING_SIGNALS else signum)

    previous = {s: signal.signal(s, forward) for s in PREEMPT_SIGNALS}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return preempt_exit_code(signal.Signals(received[0]).name) if received and code != 0 else code


def exit_code(summary: dict) -> int:
    """0 completed or stopped early, 128 + signal number when preempted (143 SIGTERM or a scheduler's
    SIGUSR1, 130 SIGINT), else 1."""
    if summary["status"] in ("completed", "stopped_early"):
        return 0
    if summary["status"] == "preempted":
        return preempt_exit_code(summary["signal"])
    return 1


def format_summary(summary: dict) -> str:
    """One line for a person: status, validation metrics, steps, wall time, run directory."""
    parts = [f"status {summary['status']}"]
    if summary["status"] == "stopped_early":
        parts[0] += f" (best at step {summary['best_step']})"
    for key in sorted(k for k in summary if k.startswith("val_") and isinstance(summary[k], (int, float))):
        parts.append(f"{key} {summary[key]:.4f}")
    parts += [f"steps {summary['steps']}", f"wall {summary['wall_s']:.1f} s", f"run dir {summary['run_dir']}"]
    return " | ".join(parts)
