"""Two torchrun agents on this machine as two "nodes" of one job (c10d rendezvous on 127.0.0.1).

Each agent is a real ``torch.distributed.run`` with ``--nnodes 2``; they meet at the endpoint of
the first, exactly as agents on two machines do. A node can run in a directory of its own, which
stands for a machine whose disk the other does not see.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from distrun import env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(
    port: int, job: str, *keel_args: str, nproc: int = 1, max_restarts: int = 0, join_timeout: int = 60, nnodes: int = 2
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={job}",
        f"--rdzv-conf=join_timeout={join_timeout}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        "-m",
        "torchkeel.cli.main",
        "train",
        "cfg.yaml",
        "--no-progress",
        *keel_args,
    ]


@dataclass
class Node:
    process: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text()


def start_nodes(
    dirs: list[Path],
    job: str,
    *keel_args: str,
    nproc: int = 1,
    max_restarts: int = 0,
    join_timeout: int = 60,
    **extra: str,
) -> list[Node]:
    """One agent per directory (each holding cfg.yaml), all in one job."""
    port, nodes = free_port(), []
    for i, directory in enumerate(dirs):
        log = directory / f"node{i}-{job}.log"
        command = agent_command(
            port, job, *keel_args, nproc=nproc, max_restarts=max_restarts, join_timeout=join_timeout, nnodes=2
        )
        with open(log, "w") as out:
            process = subprocess.Popen(command, cwd=directory, env=env(**extra), stdout=out, stderr=subprocess.STDOUT)
        nodes.append(Node(process, log))
    return nodes


def wait_all(nodes: list[Node], timeout: float) -> list[int]:
    """Exit codes of every agent; an agent still running after ``timeout`` is killed (and fails the test)."""
    deadline, codes = time.monotonic() + timeout, []
    for node in nodes:
        try:
            codes.append(node.process.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.process.kill()
            raise AssertionError(f"the job ran past {timeout} s:\n" + "\n".join(n.text()[-2000:] for n in nodes))
    return codes
