"""The doctor's checks: small pure functions from ``Facts`` to a ``Finding`` (ok / warn / fail).

Each says what it saw (``evidence``) and, when something is wrong, the one-line ``fix``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from torchkeel.env.cpus import usable_cpus
from torchkeel.env.facts import Facts

# Oldest driver each CUDA major version runs on (NVIDIA's compatibility table, Linux).
MIN_DRIVER = {11: (450, 80), 12: (525, 60), 13: (580, 0)}
DOCKER_DEFAULT_SHM = 64 * 2**20


@dataclass
class Finding:
    check: str
    status: str  # "ok" | "warn" | "fail"
    evidence: str
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_versions(f: Facts) -> Finding:
    build = f"CUDA {f.torch_cuda}" if f.torch_cuda else f"ROCm {f.torch_hip}" if f.torch_hip else "CPU"
    missing = [name for name, present in f.extras.items() if not present]
    evidence = (
        f"Python {f.python_version}, torch {f.torch_version} ({build} build), torchkeel {f.torchkeel_version}; "
        f"extras installed: {', '.join(n for n, p in f.extras.items() if p) or 'none'}"
    )
    return Finding(
        "versions", "ok", evidence, f"pip install 'torchkeel[{','.join(missing)}]' for the rest" if missing else ""
    )


def check_cuda_driver(f: Facts) -> Finding:
    if not f.torch_cuda:
        return Finding("cuda driver", "ok", "CPU-only torch build: no CUDA runtime to match")
    if f.driver_version is None:
        return Finding(
            "cuda driver",
            "fail",
            f"torch needs CUDA {f.torch_cuda}, but no NVIDIA driver was found (no NVML, no nvidia-smi)",
            "install the NVIDIA driver, or install the CPU build of torch",
        )
    major = int(f.torch_cuda.split(".")[0])
    need = MIN_DRIVER.get(major)
    have = tuple(int(p) for p in f.driver_version.split(".")[:2] if p.isdigit())
    evidence = f"torch's CUDA runtime {f.torch_cuda} (torch.version.cuda — not nvcc's), driver {f.driver_version}"
    if need is not None and have < need:
        wanted = f"{need[0]}.{need[1]:02d}"
        return Finding(
            "cuda driver",
            "fail",
            f"{evidence}: CUDA {major}.x needs a driver >= {wanted}",
            f"install NVIDIA driver >= {wanted}, or a torch build for an older CUDA "
            f"(drivers are backward- but not forward-compatible)",
        )
    return Finding("cuda driver", "ok", evidence)


def check_gpus(f: Facts) -> Finding:
    visible = f.env.get("CUDA_VISIBLE_DEVICES")
    note = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    if not f.cuda_available:
        status = "warn" if f.torch_cuda else "ok"
        return Finding(
            "gpus",
            status,
            f"no usable GPU{note}",
            "check CUDA_VISIBLE_DEVICES and the driver (see 'cuda driver')" if f.torch_cuda else "",
        )
    names = ", ".join(f"{g['index']}: {g['name']} ({g['memory_bytes'] / 2**30:.0f} GiB)" for g in f.gpus)
    smoke = f.smoke_test or {}
    if smoke and not smoke.get("ok"):
        return Finding(
            "gpus",
            "fail",
            f"{names}; allocate + matmul failed: {smoke.get('error')}{note}",
            "the runtime loads but kernels fail: check the driver version and 'library conflicts'",
        )
    timing = f"; matmul smoke test {smoke['ms']} ms" if smoke else ""
    cudnn = f"; cuDNN {f.cudnn_version}" if f.cudnn_version else ""
    return Finding("gpus", "ok", f"{names}{cudnn}{timing}{note}")


def check_library_conflicts(f: Facts) -> Finding:
    problems, evidence = [], []
    for kind in ("cudart", "cudnn", "nccl"):
        visible = f.visible_libs.get(kind, [])
        loaded = f.loaded_libs.get(kind, [])
        if loaded:
            evidence.append(f"torch loaded {kind}: {', '.join(loaded)}")
        others = [p for p in visible if p not in loaded]
        if len(visible) > 1 or (loaded and others):
            problems.append(f"{len(visible)} {kind} libraries visible ({', '.join(visible)})")
    if f.conda_prefix and f.torch_from_pip:
        problems.append(f"torch was installed by pip inside the conda environment {f.conda_prefix}")
    if problems:
        return Finding(
            "library conflicts",
            "warn",
            "; ".join(problems + evidence),
            "keep one CUDA runtime on LD_LIBRARY_PATH (torch's wheels bring their own), and install torch "
            "with one tool per environment",
        )
    return Finding(
        "library conflicts", "ok", "; ".join(evidence) or "no CUDA, cuDNN or NCCL libraries on the search path"
    )


def check_shared_memory(f: Facts) -> Finding:
    if f.shm_bytes is None:
        return Finding("shared memory", "ok", "no /dev/shm on this system")
    need = f.workers * f.batch_size * (f.sample_bytes or 64 * 1024) * 2  # two batches in flight per worker
    evidence = f"/dev/shm {f.shm_bytes / 2**20:.0f} MB for {f.workers} workers x batch {f.batch_size}"
    if f.workers and (f.shm_bytes <= DOCKER_DEFAULT_SHM or f.shm_bytes < need):
        return Finding(
            "shared memory",
            "warn",
            f"{evidence} (about {need / 2**20:.0f} MB needed): DataLoader workers die with 'bus error'",
            "run the container with --shm-size=8g (or --ipc=host), or lower data.num_workers",
        )
    return Finding("shared memory", "ok", evidence)


def check_start_method(f: Facts) -> Finding:
    if f.start_method in ("spawn", "forkserver"):
        return Finding(
            "start method",
            "warn",
            f"multiprocessing start method '{f.start_method}': workers re-import __main__ and pickle the dataset",
            'build loaders inside `if __name__ == "__main__":` and avoid lambdas in transforms',
        )
    return Finding("start method", "ok", f"multiprocessing start method '{f.start_method}'")


def check_cpus(f: Facts) -> Finding:
    suggested = max(0, min(8, f.cpu_affinity - 1))
    evidence = f"{f.cpu_count} CPUs, {f.cpu_affinity} usable by this process; suggested data.num_workers: {suggested}"
    if f.cpu_affinity < f.cpu_count:
        return Finding(
            "cpus",
            "warn",
            evidence + " (the affinity mask hides some CPUs)",
            "check taskset/cgroup limits if this process should use more",
        )
    return Finding("cpus", "ok", evidence)


def check_threads(f: Facts) -> Finding:
    """torch's intra-op threads against the CPUs this process may use and the machine's load."""
    usable = usable_cpus(f.cpu_affinity, f.cgroup_cpus)
    quota = f", cgroup quota {f.cgroup_cpus:g} CPUs" if f.cgroup_cpus is not None else ""
    evidence = f"torch uses {f.torch_threads} threads; this process may use {usable} CPUs ({f.cpu_affinity} in its affinity mask{quota})"
    if f.load_1m is not None:
        evidence += f"; load average {f.load_1m:.1f} on {f.cpu_count} CPUs"
    if f.torch_threads > usable:
        return Finding(
            "threads",
            "warn",
            evidence,
            f"set OMP_NUM_THREADS={usable} (keel train sets it itself when "
            "unset): more threads than CPUs wait for each other and can make a step many times slower",
        )
    if f.load_1m is not None and f.load_1m + f.torch_threads > f.cpu_count + 0.5:
        free = max(1, min(usable, int(f.cpu_count - f.load_1m)))
        return Finding(
            "threads",
            "warn",
            evidence + ": other processes keep the CPUs busy",
            f"with this load {f.torch_threads} threads contend for the CPUs; set OMP_NUM_THREADS={free} "
            "or free the CPUs, and time a step to compare",
        )
    return Finding("threads", "ok", evidence)


# What each commonly set variable does, shown beside its value.
DIST_VARIABLES = {
    "NCCL_DEBUG": "NCCL logs its setup and errors (INFO, WARN)",
    "NCCL_SOCKET_IFNAME": "network interface of NCCL's sockets (a wrong one hangs at init)",
    "NCCL_IB_DISABLE": "1: no InfiniBand/RoCE, sockets only",
    "NCCL_P2P_DISABLE": "1: no direct GPU-to-GPU copies (slower)",
    "NCCL_SHM_DISABLE": "1: no shared-memory transport between local GPUs (slower)",
    "NCCL_ASYNC_ERROR_HANDLING": "abort on a timeout instead of hanging (old name)",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "abort the communicator on a timeout instead of hanging",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "flight recorder of recent collectives: names the missing rank on a timeout",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "write the flight recorder when the watchdog fires",
    "TORCH_NCCL_BLOCKING_WAIT": "collectives block the host and raise on timeout",
    "GLOO_SOCKET_IFNAME": "network interface of gloo (CPU jobs)",
    "MASTER_ADDR": "host of the rendezvous store",
    "MASTER_PORT": "port of the rendezvous store",
}


def check_distributed_env(f: Facts) -> Finding:
    names = sorted(k for k in f.env if k.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_", "MASTER_")))
    if not names:
        return Finding("distributed env", "ok", "no NCCL/Gloo/MASTER_* variables set")
    shown = "; ".join(f"{k}={f.env[k]}" + (f" ({DIST_VARIABLES[k]})" if k in DIST_VARIABLES else "") for k in names)
    if f.master_reachable is False:
        return Finding(
            "distributed env",
            "fail",
            f"{shown}; MASTER_ADDR:MASTER_PORT is not reachable ({f.master_error})",
            "start rank 0 first, or fix MASTER_ADDR/MASTER_PORT and the firewall",
        )
    risky = [k for k in names if k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")]
    if risky:
        return Finding(
            "distributed env", "warn", shown, f"{', '.join(risky)} slow collectives down; unset them unless needed"
        )
    return Finding(
        "distributed env", "ok", shown + ("; MASTER_ADDR:MASTER_PORT reachable" if f.master_reachable else "")
    )


def check_nproc(f: Facts) -> Finding:
    if f.nproc is None:
        return Finding("ranks per node", "ok", "no --nproc given")
    gpus = len(f.gpus)
    if not f.cuda_available:
        if f.nproc > f.cpu_affinity:
            return Finding(
                "ranks per node",
                "warn",
                f"--nproc {f.nproc} CPU ranks (gloo) on {f.cpu_affinity} usable CPUs",
                f"use at most {f.cpu_affinity} CPU ranks, with OMP_NUM_THREADS=1",
            )
        return Finding("ranks per node", "ok", f"--nproc {f.nproc} CPU ranks (gloo), {f.cpu_affinity} usable CPUs")
    evidence = f"--nproc {f.nproc}, {gpus} visible GPU{'s' * (gpus != 1)}"
    if f.nproc > gpus:
        return Finding(
            "ranks per node",
            "fail",
            evidence + ": ranks would share GPUs",
            f"use --nproc {gpus} or fewer (or check CUDA_VISIBLE_DEVICES)",
        )
    if f.nproc < gpus:
        return Finding(
            "ranks per node", "warn", evidence + ": some GPUs stay idle", f"use --nproc {gpus} to use them all"
        )
    return Finding("ranks per node", "ok", evidence + ": one rank per GPU")


def check_reproducibility(f: Facts) -> Finding:
    cublas = f.env.get("CUBLAS_WORKSPACE_CONFIG")
    if f.deterministic and f.cuda_available and cublas not in (":4096:8", ":16:8"):
        return Finding(
            "reproducibility",
            "warn",
            f"deterministic run on CUDA with CUBLAS_WORKSPACE_CONFIG={cublas!r}",
            "export CUBLAS_WORKSPACE_CONFIG=:4096:8 (torchkeel sets it when it seeds, if unset)",
        )
    return Finding("reproducibility", "ok", f"deterministic={f.deterministic}, CUBLAS_WORKSPACE_CONFIG={cublas!r}")


def check_torch_load_safety(f: Facts) -> Finding:
    version = tuple(int(p) for p in f.torch_version.split("+")[0].split(".")[:3] if p.isdigit())
    if version <= (2, 5, 1):
        return Finding(
            "torch.load safety",
            "warn",
            f"torch {f.torch_version}: torch.load(weights_only=True) can run code (advisory for <= 2.5.1)",
            "upgrade torch; torchkeel's own checkpoints never unpickle",
        )
    if version < (2, 10):
        return Finding(
            "torch.load safety",
            "warn",
            f"torch {f.torch_version}: weights_only loading has memory-corruption advisories before 2.10",
            "upgrade torch; torchkeel's own checkpoints never unpickle",
        )
    return Finding("torch.load safety", "ok", f"torch {f.torch_version}")


def check_run_dir(f: Facts) -> Finding:
    if f.run_dir is None:
        return Finding("run directory", "ok", "no --run-dir given")
    need = 3 * (f.checkpoint_bytes or 0)
    evidence = (
        f"{f.run_dir}: {f.run_dir_free_bytes / 2**30:.1f} GiB free, writable={f.run_dir_writable}, "
        f"same filesystem as the temp dir={f.same_filesystem_as_tmp}"
        + (f", last checkpoint {f.checkpoint_bytes / 2**20:.0f} MB" if f.checkpoint_bytes else "")
    )
    if not f.run_dir_writable:
        return Finding("run directory", "fail", evidence, "choose an out_dir this user can write")
    if f.run_dir_free_bytes is not None and need and f.run_dir_free_bytes < need:
        return Finding(
            "run directory",
            "fail",
            evidence + " — not enough for the next checkpoints",
            "free disk space or lower checkpoint.keep_last",
        )
    if f.same_filesystem_as_tmp is False:
        return Finding(
            "run directory",
            "warn",
            evidence,
            "torchkeel writes temporaries next to their target, so its "
            "saves stay atomic; tools that stage files in $TMPDIR and move them are not",
        )
    return Finding("run directory", "ok", evidence)


CHECKS: list[Callable[[Facts], Finding]] = [
    check_versions,
    check_cuda_driver,
    check_gpus,
    check_library_conflicts,
    check_shared_memory,
    check_start_method,
    check_cpus,
    check_threads,
    check_distributed_env,
    check_nproc,
    check_reproducibility,
    check_torch_load_safety,
    check_run_dir,
]


def run_checks(facts: Facts) -> list[Finding]:
    return [check(facts) for check in CHECKS]
