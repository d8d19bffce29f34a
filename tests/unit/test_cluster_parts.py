"""Small parts of running on clusters, without a cluster: which jobs may span machines, the exit
code of a scheduler's warning, a fault that fires once where nothing counts restarts, and the
round numbering of torchrun's restarts on a real store."""

from __future__ import annotations

import signal
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchkeel.distributed.group import round_store
from torchkeel.distributed.shared import check_shared_directory, spans_nodes
from torchkeel.errors import ConfigError
from torchkeel.testing import parse_step_faults
from torchkeel.train.preempt import PREEMPT_SIGNALS, preempt_exit_code


def test_only_jobs_with_more_ranks_than_this_machine_runs_may_span_machines():
    assert not spans_nodes(1, {})
    assert not spans_nodes(8, {"LOCAL_WORLD_SIZE": "8"})
    assert spans_nodes(16, {"LOCAL_WORLD_SIZE": "8"})
    assert spans_nodes(4, {})  # a launcher that does not say: checked


def test_a_schedulers_warning_is_a_preemption_that_exits_143():
    assert signal.SIGUSR1 in PREEMPT_SIGNALS
    assert preempt_exit_code("SIGUSR1") == preempt_exit_code("SIGTERM") == 143
    assert preempt_exit_code("SIGINT") == 130


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
