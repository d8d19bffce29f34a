"""Small parts of running on clusters, without a cluster: which jobs may span machines, the exit
code of a scheduler's warning, whether and how a stopped Slurm job is requeued, a fault that fires
once where nothing counts restarts, and the round numbering of torchrun's restarts on a real store."""

from __future__ import annotations

import signal
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchkeel.cluster.requeue import plan_requeue, requeue_job
from torchkeel.distributed.group import round_store
from torchkeel.distributed.shared import check_shared_directory, spans_nodes
from torchkeel.errors import ConfigError
from torchkeel.testing import parse_step_faults
from torchkeel.train.preempt import PREEMPT_SIGNALS, StopSignals, preempt_exit_code


def test_only_jobs_with_more_ranks_than_this_machine_runs_may_span_machines():
    assert not spans_nodes(1, {})
    assert not spans_nodes(8, {"LOCAL_WORLD_SIZE": "8"})
    assert spans_nodes(16, {"LOCAL_WORLD_SIZE": "8"})
    assert spans_nodes(4, {})  # a launcher that does not say: checked


def test_a_schedulers_warning_is_a_preemption_that_exits_143():
    assert signal.SIGUSR1 in PREEMPT_SIGNALS
    assert preempt_exit_code("SIGUSR1") == preempt_exit_code("SIGTERM") == 143
    assert preempt_exit_code("SIGINT") == 130


BATCH = {"SLURM_JOB_ID": "41", "ENVIRONMENT": "BATCH"}


@pytest.mark.parametrize(
    "stop_signal, is_main, environ, enabled, job_id",
    [
        ("SIGTERM", True, BATCH, True, "41"),  # scancel --signal=TERM, preemption
        ("SIGUSR1", True, BATCH, True, "41"),  # the warning before the time limit
        ("SIGINT", True, BATCH, True, None),  # a person's Ctrl-C
        (None, True, BATCH, True, None),  # not stopped by a signal
        ("SIGTERM", False, BATCH, True, None),  # only rank 0 asks
        ("SIGTERM", True, {}, True, None),  # not under Slurm
        ("SIGTERM", True, {"SLURM_JOB_ID": "41"}, True, None),  # salloc: not a batch job
        ("SIGTERM", True, BATCH, False, None),  # --no-requeue
    ],
)
def test_rank_0_of_a_slurm_batch_job_stopped_by_the_scheduler_plans_a_requeue(
    stop_signal, is_main, environ, enabled, job_id
):
    plan = plan_requeue(stop_signal, is_main=is_main, environ=environ, enabled=enabled)
    assert plan.job_id == job_id and plan.reason


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stand-in ``scontrol`` on PATH that records its calls and refuses a requeue when told;
    the handlers ``requeue_job`` changes are put back."""
    tool = tmp_path / "scontrol"
    tool.write_text(
        "#!/bin/bash\n"
        'echo "$@" >> "$(dirname "$0")/calls"\n'
        'if [ -e "$(dirname "$0")/refuse" ]; then echo "Job has already finished" >&2; exit 1; fi\n'
    )
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield tmp_path
    for s, handler in handlers.items():
        signal.signal(s, handler)


def test_a_hand_written_loop_requeues_its_job_once_after_a_stop_and_hears_a_refusal(scontrol):
    """What keel train does after a stop, from a loop of one's own: the stop signal recorded, the
    plan, one ``scontrol requeue`` (``None``: Slurm took it), scontrol's reason when it refuses."""
    with StopSignals() as stop:
        signal.raise_signal(signal.SIGUSR1)  # Slurm's warning, mid-step
        assert stop.name == "SIGUSR1"
    plan = plan_requeue(stop.name, is_main=True, environ=BATCH)
    assert requeue_job(plan.job_id) is None
    assert (scontrol / "calls").read_text().split("\n")[:-1] == ["requeue 41"]
    # Slurm signals every process of the job it requeues: the process ending now ignores it.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    (scontrol / "refuse").touch()
    assert requeue_job("41") == "Job has already finished"


def test_scontrol_missing_is_a_reason_not_an_error(monkeypatch, tmp_path):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        assert requeue_job("41") == "scontrol is not on PATH"
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_a_rank_stopped_by_another_ranks_signal_ends_preempted_too():
    """Every rank stops together when any rank is signalled; one that got no signal of its own
    records SIGTERM, so that its process exits 143 rather than 0 (a node reporting success)."""
    with StopSignals() as quiet:
        quiet.stop_agreed()
    assert quiet.name == "SIGTERM" and preempt_exit_code(quiet.name) == 143
    with StopSignals() as warned:
        signal.raise_signal(signal.SIGUSR1)
        warned.stop_agreed()
    assert warned.name == "SIGUSR1"  # its own signal is kept


def test_a_fault_scoped_once_fires_until_its_marker_exists(tmp_path, monkeypatch):
    marker = tmp_path / "fired"
    killed = []
    monkeypatch.setattr("os.kill", lambda pid, sig: killed.append(sig))
    hook = parse_step_faults(f"kill:2@once={marker}")
    hook(8)
    hook(8)
    assert killed == [signal.SIGKILL] and marker.exists()
    again = parse_step_faults(f"kill:2@once={marker}")  # the restarted process: the rule is gone
    again(8)
    again(8)
    assert killed == [signal.SIGKILL]


def test_every_rank_of_a_round_gets_the_namespace_rank_0_numbered():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    server.add("torchkeel/generation", 3)  # three rounds before this one
    seen = {}

    def rank(r, store):
        seen[r] = round_store(store, r)

    # Rank 1 comes first: it waits for the number rank 0 gives this round.
    waiting = threading.Thread(target=rank, args=(1, client))
    waiting.start()
    rank(0, server)
    waiting.join(timeout=10)
    seen[0].set("address", "rank-0")
    assert seen[1].get("address") == b"rank-0"  # the same namespace


def test_a_directory_every_rank_sees_passes_and_a_private_one_is_refused(tmp_path):
    shared = tmp_path / "runs" / "r" / "checkpoints"
    views: list = []

    def gather_from_two(value):  # rank 1 answers what rank 0 sent, as all_gather would
        views.append(value)
        return [value, value]

    check_shared_directory(shared, 0, gather_from_two)  # rank 0 alone: it sees its own file
    assert not list(tmp_path.rglob(".keel-shared-*"))  # and removes it
    answers = iter([[(0, "rank-0-probe")], [(True, "a"), (False, "b")]])
    with pytest.raises(ConfigError, match="is not shared across the job's machines: rank 1 on b"):
        check_shared_directory(shared, 1, lambda value: next(answers), settle_s=0.2)


def test_ray_gets_the_numbers_of_train_and_val_rows_only():
    from torchkeel.integrations.ray import _report

    sent = []
    rows = [
        {"kind": "train", "step": 10, "loss": 0.5, "lr": 1e-3, "wall_s": 1.2, "note": "text", "nonfinite": False},
        {"kind": "val", "step": 10, "val_loss": 0.4},
        {"kind": "resume", "step": 6, "checkpoint": "runs/x/step-6"},
        {"kind": "dist", "step": 0, "world_size": 2},
    ]
    for row in rows:
        _report(sent.append, row)
    assert sent == [
        {"kind": "train", "step": 10, "loss": 0.5, "lr": 1e-3, "wall_s": 1.2},
        {"kind": "val", "step": 10, "val_loss": 0.4},
    ]
