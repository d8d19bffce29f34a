"""Facts about this machine and Python environment, collected once as plain data.

``collect_facts`` reads; the checks in ``torchkeel.env.checks`` only judge. A test builds a
``Facts`` by hand to play any machine: a too-old driver, two CUDA runtimes, a 64 MB /dev/shm.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchkeel._version import __version__
from torchkeel.env.cpus import affinity_cpus, cgroup_cpus, load_average
from torchkeel.errors import first_line

EXTRAS = {"demo": "sklearn", "data": "pyarrow", "report": "matplotlib", "export": "onnxruntime", "serve": "starlette"}
ENV_PREFIXES = (
    "NCCL_",
    "TORCH_NCCL_",
    "GLOO_",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "CUBLAS_WORKSPACE_CONFIG",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)
_LIB = re.compile(r"lib(cudart|cudnn|nccl)\.so[.\d]*$")


@dataclass
class Facts:
    python_version: str = ""
    torch_version: str = ""
    torchkeel_version: str = ""
    torch_cuda: str | None = None  # torch.version.cuda: the runtime that matters
    torch_hip: str | None = None
    cuda_available: bool = False
    driver_version: str | None = None
    cudnn_version: int | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    smoke_test: dict[str, Any] | None = None
    extras: dict[str, bool] = field(default_factory=dict)
    visible_libs: dict[str, list[str]] = field(default_factory=dict)  # kind → paths on LD_LIBRARY_PATH / ldconfig
    loaded_libs: dict[str, list[str]] = field(default_factory=dict)  # kind → paths mapped into this process
    conda_prefix: str | None = None
    torch_from_pip: bool | None = None
    shm_bytes: int | None = None
    start_method: str = ""
    cpu_count: int = 1
    cpu_affinity: int = 1
    cgroup_cpus: float | None = None  # the cgroup's CPU quota, in CPUs (None: no quota)
    load_1m: float | None = None  # the machine's 1-minute load average
    torch_threads: int = 1  # torch's intra-op threads in this process
    env: dict[str, str] = field(default_factory=dict)
    workers: int = 0  # DataLoader workers the run is configured with (or would be)
    batch_size: int = 32
    sample_bytes: int | None = None
    deterministic: bool = False
    run_dir: str | None = None
    run_dir_free_bytes: int | None = None
    run_dir_writable: bool | None = None
    checkpoint_bytes: int | None = None
    same_filesystem_as_tmp: bool | None = None
    nproc: int | None = None  # the ranks per node the user plans (keel doctor --nproc)
    master_reachable: bool | None = None  # MASTER_ADDR:MASTER_PORT accepts a TCP connection (None: not set)
    master_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def collect_facts(run_dir: str | Path | None = None, smoke_test: bool = True, nproc: int | None = None) -> Facts:
    """Everything the checks need, read from this process and machine (a few hundred ms on a CPU)."""
    facts = Facts(
        python_version=platform.python_version(),
        torch_version=torch.__version__,
        torchkeel_version=__version__,
        torch_cuda=torch.version.cuda,
        torch_hip=getattr(torch.version, "hip", None),
        cuda_available=torch.cuda.is_available(),
        extras={extra: importlib.util.find_spec(module) is not None for extra, module in EXTRAS.items()},
        conda_prefix=os.environ.get("CONDA_PREFIX"),
        torch_from_pip=_torch_from_pip(),
        start_method=multiprocessing.get_start_method(allow_none=True) or _default_start_method(),
        cpu_count=os.cpu_count() or 1,
        cpu_affinity=affinity_cpus(),
        cgroup_cpus=cgroup_cpus(),
        load_1m=load_average(),
        torch_threads=torch.get_num_threads(),
        env={k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
    )
    facts.workers = min(8, max(0, facts.cpu_affinity - 1))
    if Path("/dev/shm").is_dir():
        stat = os.statvfs("/dev/shm")
        facts.shm_bytes = stat.f_blocks * stat.f_frsize
    if torch.backends.cudnn.is_available():
        facts.cudnn_version = torch.backends.cudnn.version()
    facts.driver_version = _driver_version()
    if facts.cuda_available:
        facts.gpus = [
            {
                "index": i,
                "name": torch.cuda.get_device_name(i),
                "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
            }
            for i in range(torch.cuda.device_count())
        ]
        if smoke_test:
            facts.smoke_test = _smoke_test()
    facts.visible_libs = _visible_libs()
    facts.loaded_libs = _loaded_libs()
    if run_dir is not None:
        _run_dir_facts(facts, Path(run_dir))
    facts.nproc = nproc
    if "MASTER_ADDR" in facts.env and "MASTER_PORT" in facts.env:
        facts.master_reachable, facts.master_error = _reachable(facts.env["MASTER_ADDR"], facts.env["MASTER_PORT"])
    return facts


def _reachable(host: str, port: str, timeout_s: float = 2.0) -> tuple[bool, str | None]:
    """Whether a TCP connection to ``host:port`` opens (the rendezvous store of a running job)."""
    import socket

    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True, None
    except (OSError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def _driver_version() -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001 - no NVML: try nvidia-smi
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def _smoke_test() -> dict[str, Any]:
    try:
        start = time.perf_counter()
        a = torch.randn(1024, 1024, device="cuda")
        (a @ a).sum().item()
        del a
        torch.cuda.empty_cache()
        return {"ok": True, "ms": round((time.perf_counter() - start) * 1e3, 1)}
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return {"ok": False, "error": f"{type(exc).__name__}: {first_line(exc)}"}


def _visible_libs() -> dict[str, list[str]]:
    found: dict[str, set[str]] = {"cudart": set(), "cudnn": set(), "nccl": set()}
    for directory in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        try:
            for entry in os.scandir(directory):
                if m := _LIB.search(entry.name):
                    found[m.group(1)].add(os.path.realpath(entry.path))
        except OSError:
            continue
    if shutil.which("ldconfig") or Path("/sbin/ldconfig").exists():
        try:
            out = subprocess.run(
                [shutil.which("ldconfig") or "/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=5
            ).stdout
            for line in out.splitlines():
                path = line.rsplit("=>", 1)[-1].strip()
                if m := _LIB.search(Path(path).name):
                    found[m.group(1)].add(os.path.realpath(path))
        except (OSError, subprocess.TimeoutExpired):
            pass
    return {k: sorted(v) for k, v in found.items()}


def _loaded_libs() -> dict[str, list[str]]:
    found: dict[str, set[str]] = {"cudart": set(), "cudnn": set(), "nccl": set()}
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = line.split()[-1] if line.split() else ""
            if m := _LIB.search(Path(path).name):
                found[m.group(1)].add(path)
    return {k: sorted(v) for k, v in found.items()}


def _torch_from_pip() -> bool | None:
    try:
        from importlib.metadata import distribution

        installer = distribution("torch").read_text("INSTALLER")
        return None if installer is None else installer.strip() == "pip"
    except Exception:  # noqa: BLE001 - metadata missing
        return None


def _default_start_method() -> str:
    return "fork" if sys.platform.startswith("linux") else "spawn"


def _run_dir_facts(facts: Facts, run_dir: Path) -> None:
    facts.run_dir = str(run_dir)
    target = run_dir if run_dir.exists() else run_dir.parent
    while not target.exists() and target != target.parent:
        target = target.parent
    facts.run_dir_free_bytes = shutil.disk_usage(target).free
    facts.run_dir_writable = os.access(target, os.W_OK)
    facts.same_filesystem_as_tmp = os.stat(target).st_dev == os.stat(tempfile.gettempdir()).st_dev
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*")) if run_dir.exists() else []
    if checkpoints:
        facts.checkpoint_bytes = sum(f.stat().st_size for f in checkpoints[-1].iterdir() if f.is_file())
    config = run_dir / "config.yaml"
    if config.is_file():
        import yaml

        data = yaml.safe_load(config.read_text()) or {}
        facts.workers = int(data.get("data", {}).get("num_workers", facts.workers))
        facts.batch_size = int(data.get("train", {}).get("batch_size", facts.batch_size))
        facts.deterministic = bool(data.get("deterministic", False))
