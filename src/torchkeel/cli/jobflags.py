"""The arguments every launcher of a training job takes (``keel slurm``, ``keel k8s train``)."""

from __future__ import annotations

import argparse
from typing import Any


def add_job_arguments(parser: argparse.ArgumentParser, machine: str, cpus_help: str) -> None:
    """Overrides, machines, GPUs, workers and CPUs of each ``machine`` (a node, a pod), restarts."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    parser.add_argument("--nodes", type=int, required=True, help=f"{machine}s to train on")
    parser.add_argument("--gpus-per-node", type=int, required=True, help=f"GPUs per {machine} (0: CPU)")
    parser.add_argument("--nproc-per-node", type=int, help=f"workers per {machine} (default: the GPUs, or 1)")
    parser.add_argument("--cpus-per-node", type=int, help=cpus_help)
    parser.add_argument("--max-restarts", type=int, default=3, help="worker failures torchrun recovers from")


def job_fields(args: argparse.Namespace) -> dict[str, Any]:
    """What ``add_job_arguments`` parsed, as the job specs (``SlurmJob``, ``TrainSpec``) name it."""
    return {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "overrides": list(args.overrides),
        "nproc_per_node": args.nproc_per_node,
        "cpus_per_node": args.cpus_per_node,
        "max_restarts": args.max_restarts,
    }
