"""The doctor's checks on fabricated machines, and the real doctor on this one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import torch

from torchkeel.env import Facts, collect_facts, run_checks
from torchkeel.env.checks import (
    check_cuda_driver,
    check_distributed_env,
    check_library_conflicts,
    check_nproc,
    check_run_dir,
    check_shared_memory,
    check_start_method,
    check_torch_load_safety,
)

ROOT = Path(__file__).resolve().parents[2]


def facts(**changes) -> Facts:
    base = Facts(
        python_version="3.11.7",
        torch_version="2.13.0+cu128",
        torchkeel_version="0.1.0",
        torch_cuda="12.8",
        cuda_available=True,
        driver_version="570.86.10",
        shm_bytes=16 * 2**30,
        start_method="fork",
        cpu_count=16,
        cpu_affinity=16,
        workers=8,
        batch_size=64,
    )
    for key, value in changes.items():
        setattr(base, key, value)
    return base


def test_old_driver_for_the_runtime_fails_and_names_the_driver():
    finding = check_cuda_driver(facts(torch_cuda="12.4", driver_version="470.182.03"))
    assert finding.status == "fail"
    assert "CUDA 12.x needs a driver >= 525.60" in finding.evidence and "torch.version.cuda" in finding.evidence
    assert "install NVIDIA driver >= 525.60" in finding.fix
    assert check_cuda_driver(facts(torch_cuda="13.0", driver_version="575.51")).status == "fail"
    assert check_cuda_driver(facts(torch_cuda="13.0", driver_version="580.65")).status == "ok"
    assert check_cuda_driver(facts(torch_cuda="12.8", driver_version=None)).status == "fail"
    assert check_cuda_driver(facts(torch_cuda=None)).status == "ok"


def test_two_cuda_runtimes_warn_naming_both_paths():
    conda = "/opt/conda/lib/libcudart.so.12.1.105"
    system = "/usr/local/cuda-11.8/lib64/libcudart.so.11.8.89"
    finding = check_library_conflicts(facts(visible_libs={"cudart": [conda, system]}, loaded_libs={"cudart": [conda]}))
    assert finding.status == "warn" and conda in finding.evidence and system in finding.evidence
    assert "one CUDA runtime" in finding.fix
    assert (
        check_library_conflicts(facts(visible_libs={"cudart": [conda]}, loaded_libs={"cudart": [conda]})).status == "ok"
    )
    pip_in_conda = check_library_conflicts(facts(conda_prefix="/opt/conda/envs/x", torch_from_pip=True))
    assert pip_in_conda.status == "warn" and "installed by pip inside the conda environment" in pip_in_conda.evidence


def test_docker_default_shm_with_8_workers_warns_with_the_fix():
    finding = check_shared_memory(facts(shm_bytes=64 * 2**20, workers=8))
    assert finding.status == "warn" and "/dev/shm 64 MB for 8 workers" in finding.evidence
    assert "--shm-size" in finding.fix
    assert check_shared_memory(facts(shm_bytes=64 * 2**20, workers=0)).status == "ok"


def test_unsafe_torch_versions_warn():
    assert check_torch_load_safety(facts(torch_version="2.5.1")).status == "warn"
    assert "code" in check_torch_load_safety(facts(torch_version="2.4.0+cu121")).evidence
    assert "memory-corruption" in check_torch_load_safety(facts(torch_version="2.8.0")).evidence
    assert check_torch_load_safety(facts(torch_version="2.10.0")).status == "ok"


def test_spawn_warns_and_run_dir_space():
    assert check_start_method(facts(start_method="spawn")).status == "warn"
    short = check_run_dir(
        facts(
            run_dir="/x",
            run_dir_free_bytes=10,
            run_dir_writable=True,
            checkpoint_bytes=100,
            same_filesystem_as_tmp=True,
        )
    )
    assert short.status == "fail" and "not enough" in short.evidence
    locked = check_run_dir(facts(run_dir="/x", run_dir_free_bytes=10**12, run_dir_writable=False))
    assert locked.status == "fail"


def test_this_machine(tmp_path):
    findings = run_checks(collect_facts(tmp_path))
    by_name = {f.check: f for f in findings}
    assert all(f.status != "fail" for f in findings), [f for f in findings if f.status == "fail"]
    assert "build" in by_name["versions"].evidence
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        assert "(CPU build)" in by_name["versions"].evidence
    assert "/dev/shm" in by_name["shared memory"].evidence or "no /dev/shm" in by_name["shared memory"].evidence
    assert "start method" in by_name["start method"].evidence


def test_cli_json_validates_against_the_documented_schema(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torchkeel.cli.main", "doctor", "--json", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, json.loads((ROOT / "docs" / "doctor.schema.json").read_text()))
    assert report["ok"] is True and len(report["checks"]) == 13


def test_nproc_is_checked_against_the_visible_gpus():
    two_gpus = [{"index": i, "name": "H100", "memory_bytes": 80 * 2**30} for i in range(2)]
    too_many = check_nproc(facts(gpus=two_gpus, nproc=4))
    assert too_many.status == "fail" and "--nproc 4, 2 visible GPUs" in too_many.evidence
    assert "use --nproc 2 or fewer" in too_many.fix
    assert check_nproc(facts(gpus=two_gpus, nproc=1)).status == "warn"
    assert check_nproc(facts(gpus=two_gpus, nproc=2)).status == "ok"
    cpu = check_nproc(facts(cuda_available=False, torch_cuda=None, cpu_affinity=2, nproc=4))
    assert cpu.status == "warn" and "gloo" in cpu.evidence


def test_nccl_variables_are_explained_and_an_unreachable_master_fails():
    from torchkeel.env.facts import _reachable

    finding = check_distributed_env(facts(env={"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO"}))
    assert finding.status == "ok"
    assert "NCCL_IB_DISABLE=1 (1: no InfiniBand/RoCE, sockets only)" in finding.evidence
    import socket

    with socket.socket() as server:  # a port that was free a moment ago: nothing listens there
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
    reachable, error = _reachable("127.0.0.1", str(port), timeout_s=1)
    assert reachable is False and error
    finding = check_distributed_env(
        facts(
            env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, master_reachable=reachable, master_error=error
        )
    )
    assert finding.status == "fail" and "not reachable" in finding.evidence
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert _reachable("127.0.0.1", str(server.getsockname()[1]), timeout_s=1) == (True, None)


def test_threads_are_checked_against_the_usable_cpus_and_the_load():
    from torchkeel.env.checks import check_threads

    assert check_threads(facts(cpu_count=8, cpu_affinity=8, torch_threads=8, load_1m=0.5)).status == "ok"
    quota = check_threads(facts(cpu_count=64, cpu_affinity=64, cgroup_cpus=2.0, torch_threads=32, load_1m=1.0))
    assert quota.status == "warn" and "may use 2 CPUs" in quota.evidence and "OMP_NUM_THREADS=2" in quota.fix
    busy = check_threads(facts(cpu_count=2, cpu_affinity=2, torch_threads=2, load_1m=4.0))
    assert busy.status == "warn" and "load average 4.0 on 2 CPUs" in busy.evidence and "OMP_NUM_THREADS=1" in busy.fix


def test_the_cgroup_quota_and_the_thread_choice(tmp_path):
    from torchkeel.env.cpus import cgroup_cpus, choose_threads, usable_cpus

    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpus(tmp_path) == 1.5 and usable_cpus(affinity=16, quota=1.5) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpus(tmp_path) is None and usable_cpus(affinity=16, quota=None) == 16
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpus(v1) == 4.0
    assert choose_threads(1, 8, {})[0] == 8
    assert choose_threads(4, 8, {})[0] == 2 and "4 processes" in choose_threads(4, 8, {})[1]
    assert choose_threads(16, 8, {})[0] == 1
    assert choose_threads(1, 8, {"OMP_NUM_THREADS": "3"}) == (None, "OMP_NUM_THREADS=3 is set")
