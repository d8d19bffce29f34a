"""The Trainer's use of checkpoints: async saves, resume, preemption, init_from, changed models."""

from __future__ import annotations

import json
import os
import signal

import hand_written_loop
import pytest
import torch
from torch import nn

import torchkeel as tk
from torchkeel.errors import CheckpointError
from torchkeel.train.hooks import TrainerHooks
from torchkeel.train.preempt import StopSignals


def final_state(trainer):
    found, problems = trainer.store.latest_valid()
    assert problems == []
    return found


def test_async_save_writes_the_same_checkpoints_as_sync(tiny_config, tmp_path):
    sync = tk.Trainer(tiny_config("name=sync", "checkpoint.every_steps=7"), progress=False)
    sync.fit()
    asyn = tk.Trainer(tiny_config("name=async", "checkpoint.every_steps=7", "checkpoint.async=true"), progress=False)
    summary = asyn.fit()
    assert summary["status"] == "completed"
    a, b = final_state(sync), final_state(asyn)
    assert a.step == b.step == 60  # the final save was waited for
    assert all(torch.equal(a.state["model"][k], b.state["model"][k]) for k in a.state["model"])
    assert [s for s, _ in sync.store.steps()] == [s for s, _ in asyn.store.steps()]


class SignalAt(nn.Module):
    """The example's model, sending ``signum`` to its own process during forward number ``at``."""

    def __init__(self, at, signum):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every run of the test
        self.inner = hand_written_loop.make_model()
        self.calls, self.at, self.signum = 0, at, signum

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), self.signum)
        return self.inner(x)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_preempted_run_resumes_to_identical_weights(tiny_config, tmp_path, signum):
    reference = tk.Trainer(tiny_config("name=ref", "train.accumulate=2"), model=SignalAt(0, signum), progress=False)
    reference.fit()
    torch.manual_seed(123)  # whatever the process did in between must not matter
    preempted = tk.Trainer(tiny_config("train.accumulate=2"), model=SignalAt(9, signum), progress=False)
    summary = preempted.fit()
    # Forward 9 is in step 5 (2 micro-batches a step): that step completes, then the run stops.
    assert summary["status"] == "preempted" and summary["signal"] == signal.Signals(signum).name
    assert summary["steps"] == 5 and final_state(preempted).step == 5
    assert json.loads((tmp_path / "runs" / "tiny" / "summary.json").read_text())["status"] == "preempted"
    resumed = tk.Trainer(tiny_config("train.accumulate=2"), model=SignalAt(0, signum), resume="auto", progress=False)
    assert resumed.fit()["status"] == "completed"
    ref, got = final_state(reference).state["model"], final_state(resumed).state["model"]
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    rows = tk.read_metrics(tmp_path / "runs" / "tiny" / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 31))  # one row per step, no repeats
    assert [r["step"] for r in rows if r["kind"] == "resume"] == [5]


def test_second_sigint_aborts_at_once():
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_resume_auto_without_checkpoints_starts_fresh(tiny_config):
    summary = tk.Trainer(tiny_config("train.max_steps=3"), resume="auto", progress=False).fit()
    assert summary["status"] == "completed" and summary["steps"] == 3


def test_resume_from_a_bad_path_is_a_clear_error(tiny_config, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        tk.Trainer(tiny_config(), resume=tmp_path / "nope", progress=False).fit()
    trainer = tk.Trainer(tiny_config("train.max_steps=2"), progress=False)
    trainer.fit()
    path = trainer.store.path_for(2)
    (path / "state.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match=r"state.safetensors' has 10 bytes"):
        tk.Trainer(tiny_config("name=other"), resume=path, progress=False).fit()


def test_resume_into_a_changed_model_lists_the_keys(tiny_config):
    tk.Trainer(tiny_config("train.max_steps=2"), progress=False).fit()
    wider = nn.Sequential(nn.Linear(32, 80), nn.ReLU(), nn.Dropout(0.1), nn.Linear(80, 4))
    with pytest.raises(CheckpointError, match=r"shape mismatch: 0.bias \(checkpoint \(64,\), model \(80,\)\)"):
        tk.Trainer(tiny_config("train.max_steps=2"), model=wider, resume="auto", progress=False).fit()


def test_init_from_loads_weights_only(tiny_config, tmp_path):
    source = tk.Trainer(tiny_config("name=source", "train.max_steps=4"), progress=False)
    source.fit()
    path = source.store.path_for(4)
    tuned = tk.Trainer(tiny_config("name=tuned", f"model.init_from={path}"), progress=False)
    for key, value in source.model.state_dict().items():
        assert torch.equal(tuned.model.state_dict()[key], value)
    assert tuned.scheduler.last_epoch == 0  # weights only: optimizer and schedule start fresh
    other_head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 7))
    with pytest.raises(CheckpointError, match="missing|shape mismatch"):
        tk.Trainer(tiny_config("name=x", f"model.init_from={path}"), model=other_head, progress=False)
    loose = tk.Trainer(
        tiny_config("name=y", f"model.init_from={path}", "model.init_strict=false"), model=other_head, progress=False
    )
    assert torch.equal(loose.model[0].weight, source.model[0].weight)


def test_a_rank_outside_torchrun_is_a_config_error(tiny_config, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(tk.ConfigError, match="WORLD_SIZE=2 is set but not MASTER_ADDR"):
        tk.Trainer(tiny_config("train.max_steps=3"), progress=False)


def test_a_resume_says_how_its_config_differs_and_refuses_what_breaks_exactness(tiny_config, capsys):
    import torchkeel as tk

    tk.Trainer(tiny_config("train.max_epochs=1"), progress=False).fit()
    capsys.readouterr()
    with pytest.raises(
        tk.ConfigError,
        match=r"differs from checkpoint .* in what the run computes \(seed: 0 -> 3\).*"
        r"--allow-config-change",
    ):
        tk.Trainer(tiny_config("train.max_epochs=2", "seed=3"), resume="auto", progress=False).fit()
    with pytest.raises(tk.ConfigError, match=r"data.collate: \"default\" -> \"pad\"; train.batch_size: 16 -> 8"):
        tk.Trainer(tiny_config("data.collate=pad", "train.batch_size=8"), resume="auto", progress=False).fit()
    capsys.readouterr()
    summary = tk.Trainer(tiny_config("train.max_epochs=2", "data.num_workers=0"), resume="auto", progress=False).fit()
    err = capsys.readouterr().err
    assert summary["status"] == "completed" and summary["epochs"] == 2
    assert "keel: resumed: step 30 epoch 1 batch_in_epoch 0" in err  # said with progress off too
    assert (
        "config differs from the checkpoint's: train.max_epochs: 1 -> 2 (the learning-rate schedule is planned "
        "anew" in err
    )
    assert "data.num_workers" in err  # how data is loaded: printed, never refused
    allowed = tk.Trainer(
        tiny_config("train.max_epochs=3", "seed=3"), resume="auto", allow_config_change=True, progress=False
    ).fit()
    assert allowed["epochs"] == 3 and "seed: 0 -> 3 (allowed by --allow-config-change" in capsys.readouterr().err


def test_every_metrics_row_up_to_a_checkpoint_is_on_disk_before_the_checkpoint_is(tiny_config, tmp_path):
    """Rows reach metrics.jsonl at most once a second, and at every save: a run killed just after
    a checkpoint has the rows up to its step, which the resumed run does not write again."""
    metrics = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    on_disk = []

    def at(point):
        if point.endswith("after_manifest"):
            steps = [r["step"] for r in tk.read_metrics(metrics) if r["kind"] == "train"]
            on_disk.append(steps[-1] if steps else 0)

    trainer = tk.Trainer(tiny_config("checkpoint.every_steps=7"), progress=False, hooks=TrainerHooks(checkpoint=at))
    trainer.fit()
    assert on_disk[:3] == [7, 14, 21]  # log_every 1: each save's own step was on disk before it
    rows = [r["step"] for r in tk.read_metrics(metrics) if r["kind"] == "train"]
    assert rows == list(range(1, 61))


class OneBadSample(torch.utils.data.Dataset):
    """64 samples in file order (batches of 8); sample 27, in the 4th batch, fails to load."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 27:
            raise OSError("sample 27 is unreadable")
        return torch.full((8,), i / 64.0), torch.tensor(i % 2)


class StopAt(nn.Module):
    """A linear model that sends SIGTERM to its own process during forward number ``at`` (0: never)."""

    def __init__(self, at):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.calls, self.at = nn.Linear(8, 2), 0, at

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.inner(x)


def test_a_bad_sample_read_ahead_of_a_checkpoint_is_recorded_once_across_the_resume(tmp_path):
    """The loop reads one batch ahead. Stopped after step 3, the checkpoint leaves the 4th batch
    unread; the resumed run meets its bad sample, and the incident is recorded once, at the step
    that trained on that batch — in the stopped run's file too it must not be there already."""

    def run(name, at, resume=None):
        config = tk.load_config(
            None,
            [f"out_dir={tmp_path}", f"name={name}", "data.num_workers=0", "data.shuffle=false", "train.max_epochs=1"]
            + ["train.batch_size=8", "data.max_bad_fraction=0.1"],
        )
        trainer = tk.Trainer(config, model=StopAt(at), train_data=OneBadSample(), progress=False, resume=resume)
        summary = trainer.fit()
        path = tmp_path / name / "incidents.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return summary, [(r["step"], r["where"]) for r in rows if r["kind"] == "bad_sample"]

    summary, bad = run("whole", 0)
    assert summary["status"] == "completed" and bad == [(4, "dataset index 27")]
    summary, bad = run("stopped", 3)
    assert summary["status"] == "preempted" and summary["steps"] == 3 and bad == []
    summary, bad = run("stopped", 0, "auto")
    assert summary["status"] == "completed" and bad == [(4, "dataset index 27")]


def _leaf_paths(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaf_paths(value, (*prefix, key))
        else:
            yield (*prefix, key)


def test_a_checkpoint_saved_before_a_key_existed_resumes_as_if_it_held_the_default():
    """A version that lacked a key behaved as its default: no change, no refusal; only a value
    other than the default is a change, named with the default as the old value."""
    import copy

    from torchkeel.config.load import to_dict
    from torchkeel.config.schema import KeelConfig
    from torchkeel.train.resume import check_resume_config

    current = to_dict(KeelConfig())
    for path in _leaf_paths(current):
        saved = copy.deepcopy(current)
        parent = saved
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]
        assert check_resume_config({"config": saved}, current, allow=False, checkpoint="c") == [], path
    older = copy.deepcopy(current)
    del older["optim"]["decay_filter"], older["val"]
    changed = copy.deepcopy(current)
    changed["optim"]["decay_filter"] = "matrices"
    with pytest.raises(tk.ConfigError, match=r"optim.decay_filter: \"all\" -> \"matrices\""):
        check_resume_config({"config": older}, changed, allow=False, checkpoint="c")
