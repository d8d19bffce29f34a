"""``keel slurm``: the sbatch script, the warning signal's path to a checkpoint, and a real Slurm.

Without Slurm: the script's text and syntax, its errors, and SIGUSR1 (Slurm's warning before the
time limit) through ``keel train`` and through torchrun to every worker. Stand-ins for ``srun``
(which runs the task in its own place) and ``scontrol`` (which records its calls) run the batch
scripts as Slurm runs them: the job step signalled without ``--batch``, in the script ``keel
slurm`` writes and in a user's own ``srun keel train``; the job must exit non-zero and ask for one
requeue. With Slurm installed (slow): a job on a one-node cluster started here is warned, saves,
is requeued and finishes from its checkpoint with the weights of an uninterrupted run; a step
signalled with ``scancel --signal=TERM`` (no ``--batch``) is requeued, in both kinds of script.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distrun import env, final, keel_command, write_config
from slurmd import job_state, missing, slurm_cluster, wait_for

from torchkeel.cli.main import main
from torchkeel.cluster.slurm import SlurmJob, sbatch_script


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slurm")
    write_config(directory)
    return directory


def script(**changes) -> str:
    job = {"config": "/shared/cfg.yaml", "nodes": 4, "gpus_per_node": 8, "time": "04:00:00", **changes}
    return sbatch_script(SlurmJob(**job))


def sbatch_options(text: str) -> dict[str, str]:
    lines = [line[len("#SBATCH --") :] for line in text.splitlines() if line.startswith("#SBATCH --")]
    return dict((*line.split("=", 1), "")[:2] for line in lines)  # a flag without a value maps to ""


def test_the_script_asks_slurm_for_nodes_gpus_a_warning_and_requeue():
    text = script(partition="gpu", account="ml", overrides=["optim.lr=3e-4", "name=my run"], warn_s=300)
    options = sbatch_options(text)
    assert options["nodes"] == "4" and options["ntasks-per-node"] == "1" and options["gpus-per-node"] == "8"
    assert options["time"] == "04:00:00" and options["partition"] == "gpu" and options["account"] == "ml"
    assert options["signal"] == "B:USR1@300" and options["requeue"] == ""
    launch = text[text.index("srun ") : text.index("&\nstep=")]
    for flag in (
        '--nnodes "$SLURM_NNODES"',
        "--nproc-per-node 8",
        "--rdzv-backend c10d",
        '--rdzv-endpoint "$head_node:$port"',
        '--rdzv-id "$SLURM_JOB_ID"',
        "--signals-to-handle SIGTERM,SIGINT,SIGUSR1",
        "--resume auto",
        '"$KEEL_BIN/python3" -m torchkeel.cluster.torchrun',
    ):
        assert flag in launch
    assert "/shared/cfg.yaml" in launch and "'name=my run'" in launch  # quoted for the shell
    # Rank 0 of keel train requeues the job: the script must not ask a second time.
    assert "scontrol requeue" not in text and "--no-requeue" not in launch
    off = script(requeue=False)
    assert "no-requeue" in sbatch_options(off) and "requeue" not in sbatch_options(off)
    assert "--no-requeue" in off[off.index("srun ") :]
    checked = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr


def test_the_task_gets_the_nodes_cpus_the_directory_and_a_sigterm_that_saves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    whole = script(gpus_per_node=0)
    launch = whole[whole.index("srun ") : whole.index("&\nstep=")]
    assert "exclusive" in sbatch_options(whole) and '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in launch
    assert sbatch_options(whole)["chdir"] == str(tmp_path)  # relative paths as where keel slurm ran
    told = script(gpus_per_node=0, cpus_per_node=12)
    assert sbatch_options(told)["cpus-per-task"] == "12" and "exclusive" not in sbatch_options(told)
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in told[told.index("srun ") :]  # srun does not inherit it
    assert "trap on_term TERM" in whole and 'kill -TERM "$step"' in whole


FAKE_SRUN = """#!/bin/bash
echo "$@" > "$LOG/srun.args"
trap 'echo TERM >> "$LOG/srun.signals"; exit 143' TERM
trap 'echo USR1 >> "$LOG/srun.signals"; exit 143' USR1
touch "$LOG/srun.started"
for _ in $(seq 600); do sleep 0.05; done
"""
FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> "$LOG/scontrol.calls"
if [ "$1" = show ]; then echo node0; fi
"""


def test_sigterm_to_the_batch_shell_reaches_the_step_and_the_script_does_not_requeue(tmp_path):
    """scancel and a CANCEL-mode preemption signal the batch shell: stand-ins for srun and scontrol
    record what the script does with it (the step's rank 0 requeues, not the script)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script(gpus_per_node=0, nodes=1))
    variables = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node0", "SLURM_NNODES": "1", "SLURM_CPUS_ON_NODE": "2"}
    environment = {**os.environ, **variables, "LOG": str(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    shell = subprocess.Popen(
        ["bash", str(tmp_path / "job.sbatch")], env=environment, cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "srun.started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        shell.send_signal(signal.SIGTERM)
        out, _ = shell.communicate(timeout=20)
    finally:
        if shell.poll() is None:
            shell.kill()
    assert shell.returncode == 143 and "SIGTERM: passing it to the job step" in out
    assert (tmp_path / "srun.signals").read_text().split() == ["TERM"]
    assert "requeue" not in (tmp_path / "scontrol.calls").read_text()
    assert "--cpus-per-task=2" in (tmp_path / "srun.args").read_text()


def test_cpu_nodes_run_one_worker_each_unless_told_otherwise():
    assert "gpus-per-node" not in sbatch_options(script(gpus_per_node=0))
    assert "--nproc-per-node 1 " in script(gpus_per_node=0)
    assert "--nproc-per-node 16 " in script(gpus_per_node=0, nproc_per_node=16)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--time", "4h"], "--time '4h' is not HH:MM:SS"),
        (["--time", "00:01:00"], "--warn-s 120 is not shorter than --time 00:01:00"),
        (["--time", "01:00:00", "--nodes", "0"], "--nodes must be >= 1"),
    ],
)
def test_bad_flags_are_usage_errors(work, flags, message, capsys, monkeypatch):
    monkeypatch.chdir(work)
    args = {"--nodes": "2", "--gpus-per-node": "0"}
    for key, value in zip(flags[::2], flags[1::2]):
        args[key] = value
    code = main(["slurm", "cfg.yaml", *[w for kv in args.items() for w in kv]])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_job_that_would_fail_on_the_nodes_is_refused_before_the_script_is_written(work, capsys, monkeypatch):
    monkeypatch.chdir(work)
    flags = ["--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "2", "--time", "00:10:00", "-o", "bad.sbatch"]
    assert main(["slurm", "cfg.yaml", "train.batch_size=66", *flags]) == 2
    assert "train.batch_size 66 does not divide by the world size 4" in capsys.readouterr().err
    assert main(["slurm", "cfg.yaml", "model.target=nowhere:Net", *flags]) == 2
    assert "model.target='nowhere:Net': cannot import module 'nowhere'" in capsys.readouterr().err
    assert not (work / "bad.sbatch").exists()


def test_submit_without_sbatch_says_where_to_submit(work, capsys, monkeypatch):
    monkeypatch.chdir(work)
    monkeypatch.setenv("PATH", str(work))
    code = main(["slurm", "cfg.yaml", "--nodes", "1", "--gpus-per-node", "0", "--time", "00:10:00", "--submit"])
    assert code == 2
    assert "sbatch is not on PATH here; submit slurm-run.sbatch from a Slurm login node" in capsys.readouterr().err
    assert (work / "slurm-run.sbatch").exists()


def wait_for_step(work, name, step, process):
    metrics = work / "runs" / name / "metrics.jsonl"
    wait_for(
        lambda: metrics.exists() and f'"step": {step},' in metrics.read_text() or process.poll() is not None,
        120,
        f"step {step}",
    )


def summary(work, name):
    return json.loads((work / "runs" / name / "summary.json").read_text())


def warned(work, name, command, faults, recorded="SIGUSR1"):
    """Run ``command`` (a training of ``name``), send SIGUSR1 once step 5 is logged; its exit code and
    stderr. ``recorded``: the signal the workers got, as the summary names it.

    A 2 s pause before the 12th forward pass makes the signal's arrival mid-run certain."""
    process = subprocess.Popen(
        command,
        cwd=work,
        env=env(TORCHKEEL_TEST_STEP_FAULTS=faults),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(work, name, 5, process)
    process.send_signal(signal.SIGUSR1)
    _, err = process.communicate(timeout=120)
    stopped = summary(work, name)
    assert stopped["status"] == "preempted" and stopped["signal"] == recorded, err[-3000:]
    assert final(work, name)[0].step == stopped["steps"] < 400  # the checkpoint of the step it stopped at
    return process.returncode, err


def test_the_warning_signal_saves_and_exits_143_like_sigterm(work):
    command = [
        sys.executable,
        "-m",
        "torchkeel.cli.main",
        "train",
        "cfg.yaml",
        "--no-progress",
        "name=usr1",
        "train.max_steps=400",
    ]
    code, err = warned(work, "usr1", command, "sleep:12=2")
    assert code == 143, err[-3000:]


def test_torchrun_passes_the_warning_to_every_worker_and_ends_without_a_traceback(work):
    """As the sbatch script runs it: torchrun's own ending on a handled signal is a traceback and
    exit 1; keel's entry to it says one line and exits 143, as a stopped keel train does: the run
    has not finished, so it must not end as a success (Slurm would record the job COMPLETED)."""
    command = [
        sys.executable,
        "-m",
        "torchkeel.cluster.torchrun",
        "--standalone",
        "--nproc-per-node=2",
        "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1",
        "--monitor-interval=0.2",
        *keel_command(1, "name=usr1-dist", "train.max_steps=400")[1:],
    ]
    code, err = warned(work, "usr1-dist", command, "sleep:12=2@rank=0")
    assert "keel: rank 1: stopped by SIGUSR1" in err and "(exit 143)" in err, err[-3000:]
    assert "torchrun passed SIGUSR1 on and its workers have ended" in err, err[-3000:]
    assert code == 143 and "Traceback" not in err and "SignalException" not in err, err[-3000:]


def test_keel_train_nproc_passes_the_warning_on_and_exits_143(work):
    command = keel_command(1, "name=usr1-nproc", "train.max_steps=400", "--nproc", "2")
    # keel's launcher passes the warning to torchrun as SIGTERM, which torchrun hands on by default.
    code, err = warned(work, "usr1-nproc", command, "sleep:12=2@rank=0", recorded="SIGTERM")
    assert code == 143, err[-3000:]


RUNNING_SRUN = """#!/bin/bash
# srun as one node runs a task: srun's own options dropped, the task in its place, so that a signal
# to the job step (scancel --signal without --batch) reaches the task.
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
RECORDING_SCONTROL = """#!/bin/bash
echo "$@" >> "$LOG/scontrol.calls"
if [ "$1" = show ]; then echo 127.0.0.1; fi
if [ "$1" = requeue ] && [ -n "${REFUSE_REQUEUE:-}" ]; then
    echo "Requested operation is presently disabled for job $2" >&2
    exit 1
fi
"""


def job_id_with_a_free_port() -> str:
    """A job id whose rendezvous port (20000 + id % 20000, as the script computes it) is free."""
    for job in random.sample(range(1, 20000), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 20000 + job))
            except OSError:
                continue
        return str(job)
    raise AssertionError("no free port in 20001-39999")


def step_processes(pid: int) -> list[int]:
    """``pid`` and its descendants: the processes of a job step, which slurmstepd signals together."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                queue += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def run_batch_job(work, tmp_path, text: str, name: str, **variables: str):
    """Run the batch script ``text`` as Slurm runs one (its variables, ``ENVIRONMENT=BATCH``,
    stand-in srun and scontrol); once run ``name`` logged step 5, SIGTERM every process of the job
    step but not the batch shell (``scancel --signal=TERM JOBID``, without ``--batch``). Returns
    the shell's exit code, its output and scontrol's calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (("srun", RUNNING_SRUN), ("scontrol", RECORDING_SCONTROL)):
        (bin_dir / tool).write_text(body)
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(text)
    job = job_id_with_a_free_port()
    slurm = {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "node0", "SLURM_NNODES": "1", "SLURM_CPUS_ON_NODE": "2"}
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    extra = {**slurm, "ENVIRONMENT": "BATCH", "LOG": str(tmp_path), "PATH": path, **variables}
    shell = subprocess.Popen(
        ["bash", str(tmp_path / "job.sbatch")],
        cwd=work,
        env=env(TORCHKEEL_TEST_STEP_FAULTS="sleep:12=2", **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_step(work, name, 5, shell)
        for pid in step_processes(shell.pid)[1:]:  # the shell's descendants: the job step
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        out, _ = shell.communicate(timeout=120)
    finally:
        if shell.poll() is None:
            shell.kill()
    calls = (tmp_path / "scontrol.calls").read_text().splitlines() if (tmp_path / "scontrol.calls").exists() else []
    return shell.returncode, out, job, calls


def test_a_keel_slurm_job_whose_step_is_signalled_exits_143_and_rank_0_requeues_it_once(work, tmp_path):
    """``scancel --signal=TERM JOBID`` signals the step, not the batch shell: the shell's trap never
    runs. Before, torchrun's entry turned the stop into exit 0 and nothing requeued the job: Slurm
    recorded an unfinished run COMPLETED."""
    overrides = ["name=step-term", "train.max_steps=400"]
    text = script(config=str(work / "cfg.yaml"), nodes=1, gpus_per_node=0, overrides=overrides, chdir=str(work))
    code, out, job, calls = run_batch_job(work, tmp_path, text, "step-term")
    stopped = summary(work, "step-term")
    assert stopped["status"] == "preempted" and stopped["signal"] == "SIGTERM", out[-3000:]
    assert final(work, "step-term")[0].step == stopped["steps"] < 400
    assert code == 143, out[-3000:]
    assert [c for c in calls if c.startswith("requeue")] == [f"requeue {job}"], out[-3000:]
    assert "Traceback" not in out, out[-3000:]


USERS_SCRIPT = """#!/bin/bash
#SBATCH --requeue
#SBATCH --time=01:00:00
srun keel train cfg.yaml --no-progress {args}
"""


@pytest.mark.parametrize("refused", [False, True], ids=["requeued", "requeue-refused"])
def test_a_users_own_srun_keel_train_is_requeued_by_rank_0_and_never_exits_0(work, tmp_path, refused):
    """A hand-written batch script (as Lightning users write them): the requeue comes from the
    training process, whatever the script. A refused requeue (``--no-requeue``, a job already
    ending) is one line, and the job still exits 143: FAILED, not COMPLETED."""
    name = f"own-{'refused' if refused else 'requeued'}"
    text = USERS_SCRIPT.format(args=f"name={name} train.max_steps=400")
    code, out, job, calls = run_batch_job(work, tmp_path, text, name, **({"REFUSE_REQUEUE": "1"} if refused else {}))
    assert summary(work, name)["status"] == "preempted", out[-3000:]
    assert code == 143, out[-3000:]
    assert calls == [f"requeue {job}"], out[-3000:]
    refusal = [line for line in out.splitlines() if "could not requeue" in line]
    assert len(refusal) == (1 if refused else 0) and "Traceback" not in out, out[-3000:]


def test_keel_slurm_imports_the_configs_modules_from_the_directory_it_runs_in(work, tmp_path):
    """A model class in mymodels.py next to the config: the nodes' keel train runs in that directory
    (``--chdir``) and imports it; the console script ``keel slurm`` checked the config from where
    it was installed and refused it (exit 2)."""
    (tmp_path / "mymodels.py").write_text(
        "from distmodels import mlp\n\n\ndef Net(**kwargs):\n    return mlp(**kwargs)\n"
    )
    (tmp_path / "map.yaml").write_text((work / "cfg.yaml").read_text().replace("distmodels:mlp", "mymodels:Net"))
    flags = ["--nodes", "1", "--gpus-per-node", "0", "--time", "00:10:00", "-o", "job.sbatch"]
    keel = str(Path(sys.executable).parent / "keel")
    written = subprocess.run(
        [keel, "slurm", "map.yaml", *flags], cwd=tmp_path, env=env(), capture_output=True, text=True
    )
    assert written.returncode == 0, written.stderr
    assert sbatch_options((tmp_path / "job.sbatch").read_text())["chdir"] == str(tmp_path)
    missing_module = subprocess.run(
        [keel, "slurm", "map.yaml", "model.target=mymodelz:Net", *flags],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
    )
    assert missing_module.returncode == 2 and "cannot import module 'mymodelz'" in missing_module.stderr


@pytest.mark.slow
@pytest.mark.skipif(bool(missing()), reason=f"Slurm is not installed here (missing: {', '.join(missing())})")
def test_a_real_slurm_job_is_warned_saves_requeues_and_finishes(work, tmp_path):
    reference = subprocess.run(
        keel_command(1, "name=steady", "train.max_steps=3000", "--nproc", "2"),
        cwd=work,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    with slurm_cluster(tmp_path / "slurm") as slurm_env:
        written = subprocess.run(
            [
                sys.executable,
                "-m",
                "torchkeel.cli.main",
                "slurm",
                "cfg.yaml",
                "name=slurm",
                "train.max_steps=3000",
                "--nodes",
                "1",
                "--gpus-per-node",
                "0",
                "--nproc-per-node",
                "2",
                "--time",
                "00:10:00",
                "--warn-s",
                "60",
                "-o",
                "job.sbatch",
                "--submit",
            ],
            cwd=work,
            env=env(SLURM_CONF=slurm_env["SLURM_CONF"]),
            capture_output=True,
            text=True,
        )
        assert written.returncode == 0, written.stderr
        job = re.search(r"Submitted batch job (\d+)", written.stdout).group(1)
        log = work / f"slurm-{job}.out"
        wait_for(
            lambda: (
                log.exists() and '"step": 50,' in (work / "runs/slurm/metrics.jsonl").read_text()
                if (work / "runs/slurm/metrics.jsonl").exists()
                else False
            ),
            120,
            "training under Slurm",
        )
        # What Slurm does --warn-s before the time limit (--signal=B:USR1@60), now.
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_env, check=True)
        wait_for(lambda: job_state(job, slurm_env).get("Restarts") == "1", 120, "the requeue")
        stopped = summary(work, "slurm")
        assert stopped["status"] == "preempted" and stopped["signal"] == "SIGUSR1"
        # A requeued job waits about two minutes to be eligible; the test lets it start now.
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm_env, check=True)
        wait_for(lambda: job_state(job, slurm_env).get("JobState") == "COMPLETED", 240, "the requeued job to finish")
    text = log.read_text()
    assert "time limit in 60 s: passing SIGUSR1 to the job step" in text
    assert f"keel: asked Slurm to requeue job {job}" in text
    assert f"resumed: step {stopped['steps']}" in text and "status completed" in text
    # The step of the first start exits 143 (srun says so): a stopped run is not a success.
    assert "Traceback" not in text, text[-4000:]
    found, weights = final(work, "slurm")
    _, expected = final(work, "steady")
    assert found.step == 3000 and stopped["steps"] < 3000
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def submit(work, slurm_env, arguments: list[str]) -> str:
    """``arguments`` run in ``work`` (``keel slurm ... --submit`` or ``sbatch SCRIPT``); the job id."""
    done = subprocess.run(
        arguments, cwd=work, env=env(SLURM_CONF=slurm_env["SLURM_CONF"]), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return re.search(r"Submitted batch job (\d+)", done.stdout).group(1)


def signal_the_step_and_wait_for_the_end(work, slurm_env, job: str, name: str) -> dict[str, str]:
    """Once run ``name`` logged step 20: ``scancel --signal=TERM JOBID``, without ``--batch`` (the
    job step is signalled, not the batch shell); ``scontrol show job``'s fields once the job was
    requeued or has ended."""
    metrics = work / "runs" / name / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and '"step": 20,' in metrics.read_text(), 180, f"{name} to train under Slurm")
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm_env, check=True)

    def ended() -> bool:
        state = job_state(job, slurm_env)
        return state.get("Restarts") == "1" or state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED")

    wait_for(ended, 120, f"job {job} to be requeued or to end")
    state = job_state(job, slurm_env)
    subprocess.run(["scancel", job], env=slurm_env)  # a requeued job would start again
    return state


@pytest.mark.slow
@pytest.mark.skipif(bool(missing()), reason=f"Slurm is not installed here (missing: {', '.join(missing())})")
def test_a_real_keel_slurm_job_whose_step_gets_sigterm_is_requeued_not_completed(work, tmp_path):
    """As a person stops a job step: ``scancel --signal=TERM JOBID``. Before, Slurm recorded the
    job COMPLETED with exit code 0 after a third of the run."""
    with slurm_cluster(tmp_path / "slurm") as slurm_env:
        flags = ["--nodes", "1", "--gpus-per-node", "0", "--time", "00:10:00", "--warn-s", "60"]
        keel = [sys.executable, "-m", "torchkeel.cli.main", "slurm", "cfg.yaml", "name=slurm-term"]
        job = submit(work, slurm_env, [*keel, "train.max_steps=3000", *flags, "-o", "term.sbatch", "--submit"])
        state = signal_the_step_and_wait_for_the_end(work, slurm_env, job, "slurm-term")
    stopped = summary(work, "slurm-term")
    assert stopped["status"] == "preempted" and stopped["steps"] < 3000
    assert state["Restarts"] == "1" and state["JobState"] != "COMPLETED", state
    text = (work / f"slurm-term-{job}.out").read_text()
    assert f"keel: asked Slurm to requeue job {job}" in text and "Traceback" not in text, text[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(bool(missing()), reason=f"Slurm is not installed here (missing: {', '.join(missing())})")
@pytest.mark.parametrize("requeue", ["--requeue", "--no-requeue"])
def test_a_real_plain_sbatch_of_srun_keel_train_is_requeued_or_fails_never_completed(work, tmp_path, requeue):
    """A user's own batch script, ``srun keel train cfg.yaml``: rank 0 requeues the job itself. A
    job that may not be requeued (``--no-requeue``) ends FAILED with the step's exit code 143."""
    name = f"plain{requeue.replace('-', '_')}"
    keel = Path(sys.executable).parent / "keel"
    script_path = work / f"{name}.sbatch"
    script_path.write_text(
        f"#!/bin/bash\n#SBATCH {requeue}\n#SBATCH --output={name}-%j.out\n"
        f"srun {keel} train cfg.yaml --no-progress name={name} train.max_steps=3000\n"
    )
    with slurm_cluster(tmp_path / "slurm") as slurm_env:
        job = submit(work, slurm_env, ["sbatch", str(script_path)])
        state = signal_the_step_and_wait_for_the_end(work, slurm_env, job, name)
    assert summary(work, name)["status"] == "preempted"
    if requeue == "--requeue":
        assert state["Restarts"] == "1" and state["JobState"] != "COMPLETED", state
    else:
        assert state["JobState"] == "FAILED" and state["ExitCode"] == "143:0", state
        assert "could not requeue" in (work / f"{name}-{job}.out").read_text()
