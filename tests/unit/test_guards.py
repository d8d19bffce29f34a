"""Guards: non-finite skip/rollback/raise with diagnosis, OOM splitting, memory and leak monitoring."""

from __future__ import annotations

import copy
import json
import math
import os
import random

import hand_written_loop
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchkeel as tk
from torchkeel.errors import SampleTooLarge, TrainingDiverged
from torchkeel.testing import OomInjector
from torchkeel.train.guards import Action, NonFiniteGuard, SpikeDetector
from torchkeel.train.hooks import TrainerHooks
from torchkeel.train.memory import LeakDetector, MemoryMonitor
from torchkeel.train.nonfinite import diagnose_nonfinite

CPU = torch.device("cpu")


def incidents(tmp_path, name="tiny"):
    path = tmp_path / "runs" / name / "incidents.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- skip semantics ------------------------------------------------------------------------------


def test_a_nonfinite_step_changes_nothing_bit_for_bit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = tk.build_scheduler(opt, warmup_steps=2, total_steps=10)
    good = [(torch.randn(6, 4), torch.randint(0, 3, (6,)))]
    step = tk.StepSettings(
        params=params, precision=tk.Precision(), device=CPU, clip_grad_norm_max=1.0, scheduler=sched, check_finite=True
    )
    for _ in range(2):
        assert tk.train_step(model, opt, good, nn.functional.cross_entropy, step).status == "ok"
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), sched.state_dict().copy())
    bad_inputs = torch.randn(6, 4)
    bad_inputs[2, 1] = float("nan")
    result = tk.train_step(model, opt, [(bad_inputs, torch.randint(0, 3, (6,)))], nn.functional.cross_entropy, step)
    assert result.status == "nonfinite" and result.loss_value != result.loss_value  # NaN
    for key, value in before[0].items():
        assert torch.equal(model.state_dict()[key], value)
    after = opt.state_dict()
    for index, state in before[1]["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value), key  # moments and step count
    assert after["param_groups"] == before[1]["param_groups"]
    assert sched.state_dict() == before[2]  # the schedule did not advance
    assert all(p.grad is None for p in params)  # gradients dropped


def test_guard_escalation():
    guard = NonFiniteGuard("skip", max_consecutive=3, lr_backoff=0.5, max_rollbacks=2)
    assert [guard.observe(False) for _ in range(3)] == [Action.SKIPPED, Action.SKIPPED, Action.ROLLBACK]
    assert guard.lr_scale == 0.5 and guard.observe(True) is Action.CONTINUE
    assert [guard.observe(False) for _ in range(3)][-1] is Action.ROLLBACK
    assert [guard.observe(False) for _ in range(3)][-1] is Action.FAIL
    assert guard.lr_scale == 0.25 and guard.num_rollbacks == 2
    assert NonFiniteGuard("raise").observe(False) is Action.FAIL
    assert NonFiniteGuard("rollback").observe(False) is Action.ROLLBACK
    assert NonFiniteGuard("skip", max_consecutive=1).observe(False, can_roll_back=False) is Action.FAIL


# --- NaN injection in the Trainer ----------------------------------------------------------------


class NaNOnSteps(nn.Module):
    """The example's model; on the n-th distinct training batch, n in ``bad``, it returns NaN/Inf.

    Batches are told apart by content, so the diagnosis replay of a bad batch is bad again."""

    def __init__(self, bad):
        super().__init__()
        torch.manual_seed(0)
        self.inner = hand_written_loop.make_model()
        self.bad, self.seen = set(bad), {}

    def forward(self, x):
        out = self.inner(x)
        if self.training:
            n = self.seen.setdefault(round(float(x.sum()), 3), len(self.seen) + 1)
            if n in self.bad:
                out = out * float("nan") if n % 2 else out + float("inf")
        return out


def test_three_nonfinite_steps_out_of_200_are_survived(tiny_config, tmp_path):
    args = ("train.max_epochs=null", "train.max_steps=200", "train.val_every=0")
    clean = tk.Trainer(tiny_config("name=clean", *args), model=NaNOnSteps([]), progress=False).fit()
    bad_steps = sorted(random.Random(7).sample(range(20, 200), 3))
    summary = tk.Trainer(tiny_config("name=nan", *args), model=NaNOnSteps(bad_steps), progress=False).fit()
    assert summary["status"] == "completed" and summary["incidents"] == {"nonfinite": 3}
    rows = incidents(tmp_path, "nan")
    assert [r["kind"] for r in rows] == ["nonfinite"] * 3
    assert [r["step"] for r in rows] == bad_steps
    assert rows[0]["diagnosis"]["first_module"] == "<model>" and rows[1]["diagnosis"] is None  # diagnosed once
    assert abs(summary["val_accuracy"] - clean["val_accuracy"]) <= 0.01


def regression_data(n=256, features=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    y = x @ torch.randn(features, 1, generator=g)
    return TensorDataset(x, y), TensorDataset(x[:32], y[:32])


def diverging(tmp_path, lr, name):
    train, val = regression_data()
    config = tk.load_config(
        None,
        [
            f"out_dir={tmp_path / 'runs'}",
            f"name={name}",
            "optim.name=sgd",
            f"optim.lr={lr}",
            "train.clip_grad_norm=null",
            "train.max_epochs=null",
            "train.max_steps=150",
            "train.batch_size=16",
            "guard.snapshot_every=5",
            "loss.target=torch.nn:MSELoss",
        ],
    )
    torch.manual_seed(0)
    return tk.Trainer(config, model=nn.Linear(16, 1), train_data=train, val_data=val, progress=False)


def test_a_diverging_run_rolls_back_then_fails_with_a_diagnosis(tmp_path):
    trainer = diverging(tmp_path, lr=20.0, name="absurd")
    with pytest.raises(TrainingDiverged, match="training diverged: .* 3 rollbacks; .*Lower optim.lr"):
        trainer.fit()
    summary = json.loads((tmp_path / "runs" / "absurd" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["incidents"]["rollback"] == 3
    assert summary["diagnosis"]["loss_nonfinite"] or summary["diagnosis"]["nonfinite_grads"]
    scales = [r["lr_scale"] for r in incidents(tmp_path, "absurd") if r["kind"] == "rollback"]
    assert scales == [0.5, 0.25, 0.125]


def test_a_mildly_diverging_run_recovers_after_a_rollback(tmp_path):
    trainer = diverging(tmp_path, lr=1.5, name="mild")  # diverges; stable from 1.0 down
    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["incidents"]["rollback"] >= 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    scale = trainer.guard.lr_scale
    assert scale == 0.5 ** summary["incidents"]["rollback"]
    last_rollback = max(r["step"] for r in incidents(tmp_path, "mild") if r["kind"] == "rollback")
    rows = tk.read_metrics(tmp_path / "runs" / "mild" / "metrics.jsonl")
    lrs = [r["lr"] for r in rows if r["kind"] == "train" and r["step"] > last_rollback]
    assert lrs and max(lrs) <= 1.5 * scale + 1e-12  # the backoff stays in the schedule


class SpikeOnStep(NaNOnSteps):
    """Flips and scales the logits on the n-th distinct batch: a finite loss spike."""

    def forward(self, x):
        out = self.inner(x)
        if self.training:
            n = self.seen.setdefault(round(float(x.sum()), 3), len(self.seen) + 1)
            if n in self.bad:
                out = -out * 100  # confidently wrong: a large, finite loss
        return out


def test_a_loss_spike_is_recorded_and_training_goes_on(tiny_config, tmp_path):
    summary = tk.Trainer(tiny_config("guard.spike_factor=3.0"), model=SpikeOnStep([40]), progress=False).fit()
    assert summary["status"] == "completed" and summary["incidents"] == {"spike": 1}
    (row,) = incidents(tmp_path)
    assert row["kind"] == "spike" and row["step"] == 40 and row["loss"] > 3 * row["average"]


def test_raise_policy_stops_at_the_first_nonfinite_step(tiny_config):
    trainer = tk.Trainer(tiny_config("guard.on_nonfinite=raise"), model=NaNOnSteps([4]), progress=False)
    with pytest.raises(TrainingDiverged, match="1 non-finite steps, 0 rollbacks"):
        trainer.fit()
    assert trainer.step == 4


# --- diagnosis ---------------------------------------------------------------------------------------


class LogHead(nn.Module):
    def forward(self, x):
        return torch.log(x - x)  # log(0) = -inf: the planted bug


class Planted(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(8, 3), LogHead())
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.head(self.encoder(self.norm(x)))


def test_diagnosis_names_the_planted_log_of_zero():
    model = Planted()
    running_mean = model.norm.running_mean.clone()
    torch.manual_seed(3)
    group = [(torch.randn(5, 4), torch.randint(0, 3, (5,)))]
    rng = torch.get_rng_state()
    d = diagnose_nonfinite(model, group, nn.functional.cross_entropy, precision=tk.Precision(), device=CPU)
    assert d["first_module"] == "head.1" and d["module_class"] == "LogHead"
    assert d["module_input_nonfinite"] is False and d["input_nonfinite_samples"] == []
    assert d["loss_nonfinite"] and d["backward_anomaly"] is not None
    assert "head.1 (LogHead), from finite inputs" in d["summary"]
    assert torch.equal(model.norm.running_mean, running_mean)  # the replay leaves no trace
    assert torch.equal(torch.get_rng_state(), rng)


def test_diagnosis_reports_the_samples_that_carry_nan():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    first = torch.randn(4, 4)
    second = torch.randn(4, 4)
    second[1, 2] = float("nan")
    second[3, 0] = float("inf")
    group = [(first, torch.zeros(4, dtype=torch.long)), (second, torch.zeros(4, dtype=torch.long))]
    d = diagnose_nonfinite(model, group, nn.functional.cross_entropy, precision=tk.Precision(), device=CPU)
    assert d["input_nonfinite_samples"] == [5, 7]  # sample indices within the step
    assert d["first_module"] == "0" and d["module_input_nonfinite"] is True
    assert set(d["nonfinite_grads"]) >= {"0.weight"}
    assert "the batch itself carries NaN/Inf in samples [5, 7]" in d["summary"]


# --- OOM ---------------------------------------------------------------------------------------------


def no_dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def test_oom_split_trains_to_the_same_parameters(tiny_config, tmp_path):
    args = ("train.batch_size=64", "train.clip_grad_norm=1.0", "guard.enabled=true")
    plain = tk.Trainer(tiny_config("name=plain", *args), model=no_dropout_model(), progress=False)
    plain.fit()
    injector = OomInjector(16)
    split = tk.Trainer(
        tiny_config("name=split", *args),
        model=no_dropout_model(),
        hooks=TrainerHooks(before_forward=injector),
        progress=False,
    )
    summary = split.fit()
    assert summary["status"] == "completed" and summary["incidents"] == {"oom_split": 1}
    assert injector.num_raised == 2  # 64 failed, 32 failed, 16 fit; then 16 from the start
    (row,) = [r for r in incidents(tmp_path, "split") if r["kind"] == "oom_split"]
    assert row["micro_batch_size"] == 16 and row["step"] == 1 and "micro-batches of 16 samples" in row["message"]
    for (name, a), b in zip(plain.model.named_parameters(), split.model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


def test_a_single_sample_that_does_not_fit_is_a_clear_error():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = [(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))]
    with pytest.raises(SampleTooLarge, match="a single sample does not fit in memory on cpu \\(process RSS"):
        tk.train_step(
            model,
            opt,
            batch,
            nn.functional.cross_entropy,
            tk.StepSettings(
                params=list(model.parameters()),
                precision=tk.Precision(),
                device=CPU,
                split_on_oom=True,
                hooks=TrainerHooks(before_forward=OomInjector(0)),
            ),
        )


def test_other_errors_pass_through_unchanged():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken(n):
        raise RuntimeError("CUDA error: device-side assert triggered")

    with pytest.raises(RuntimeError, match="device-side assert"):
        tk.train_step(
            model,
            opt,
            [(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))],
            nn.functional.cross_entropy,
            tk.StepSettings(
                params=list(model.parameters()),
                precision=tk.Precision(),
                device=CPU,
                split_on_oom=True,
                hooks=TrainerHooks(before_forward=broken),
            ),
        )


# --- memory and leaks -------------------------------------------------------------------------------


class FakeProbe:
    def __init__(self, rss=2**30, cuda=None):
        self.rss, self.stats = rss, cuda

    def rss_bytes(self):
        return self.rss

    def cuda(self, device):
        return None if self.stats is None else dict(self.stats)


def test_memory_monitor_on_a_fake_cuda_machine():
    GiB = 2**30
    probe = FakeProbe(
        rss=3 * GiB,
        cuda={"allocated": 6 * GiB, "reserved": 19 * GiB // 2, "peak_allocated": 9 * GiB, "total": 10 * GiB},
    )
    monitor = MemoryMonitor(torch.device("cuda"), warn_rss_gb=2.0, reader=probe)
    stats, warnings = monitor.sample()
    assert stats.row() == {
        "rss_bytes": 3 * GiB,
        "cuda_allocated_bytes": 6 * GiB,
        "cuda_reserved_bytes": 19 * GiB // 2,
        "cuda_peak_allocated_bytes": 9 * GiB,
        "fragmentation": round(1 - 6 / 9.5, 4),
    }
    assert len(warnings) == 2
    assert "RSS 3.00 GiB is above memory.warn_rss_gb=2.0" in warnings[0]
    assert "CUDA reserved memory is 95% of the device (fragmentation 37%)" in warnings[1]
    assert "expandable_segments" in warnings[1]
    assert monitor.sample()[1] == []  # still above: warned once
    probe.rss = GiB
    assert monitor.sample()[1] == []
    probe.rss = 3 * GiB
    assert len(monitor.sample()[1]) == 1  # crossed again
    assert MemoryMonitor(CPU, reader=FakeProbe()).sample()[1] == []


def run_loop(leaky, steps=60):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    detector = LeakDetector(every_steps=5, warmup_steps=5, window=4, max_overhead=float("inf"))
    total_loss = 0.0
    findings = []
    for step in range(1, steps + 1):
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if leaky:
            total_loss += loss  # keeps every step's graph alive
        else:
            total_loss += loss.item()
        finding = detector.observe(step)
        if finding:
            findings.append((step, finding))
    return findings


def test_leak_detector_catches_accumulated_loss_tensors_and_is_quiet_otherwise():
    ((step, finding),) = run_loop(leaky=True)
    assert step == 20 and finding["signal"] == "graph_nodes"
    assert finding["graph_nodes_per_step"] >= 5
    top = finding["top_groups"]
    assert all(g["holds_graph"] for g in top[:1])
    assert run_loop(leaky=False) == []


def test_leak_detector_uses_cuda_allocated_bytes_when_on_cuda():
    probe = FakeProbe(cuda={"allocated": 0, "reserved": 0, "peak_allocated": 0, "total": 1})
    detector = LeakDetector(
        every_steps=1, warmup_steps=0, window=3, max_overhead=float("inf"), device=torch.device("cuda"), reader=probe
    )
    found = []
    for step in range(6):
        probe.stats["allocated"] = 1000 * step
        found.append(detector.observe(step))
    assert found[:2] == [None, None] and found[2]["signal"] == "cuda_allocated_bytes"
    assert found[2]["bytes_per_step"] == 1000


def test_censuses_are_spaced_to_cost_at_most_their_share_of_time():
    now = [0.0]

    class SlowCensus(FakeProbe):  # the census asks the probe: each one "takes" 5 s
        def cuda(self, device):
            now[0] += 5.0
            return None

    detector = LeakDetector(
        every_steps=1,
        warmup_steps=0,
        window=3,
        max_overhead=0.1,
        first_cost_s=5.0,
        signal_every_steps=0,
        reader=SlowCensus(),
        clock=lambda: now[0],
    )
    census_steps = []
    for step in range(200):
        now[0] += 1.0  # each step "takes" 1 s
        before = [c.step for c in detector.history]
        detector.observe(step)
        if [c.step for c in detector.history] != before:
            census_steps.append(step)
    # 5 s of census may come after 50 s of training at most 10% overhead: every 50 steps.
    assert census_steps[:3] == [49, 99, 149]


def test_spike_detector():
    spikes = SpikeDetector(factor=3.0, warmup=5)
    assert [spikes.observe(1.0) for _ in range(10)] == [None] * 10
    assert spikes.observe(5.0) == pytest.approx(1.0)
    assert spikes.observe(float("nan")) is None


class LeakyLoss(nn.Module):
    """A loss that keeps a running total as a tensor: the classic leak, inside the Trainer."""

    def __init__(self, leaky):
        super().__init__()
        self.leaky, self.total = leaky, 0.0

    def forward(self, output, target):
        loss = nn.functional.cross_entropy(output, target)
        if self.leaky and torch.is_grad_enabled():
            self.total = self.total + loss
        return loss


@pytest.mark.parametrize("leaky", [True, False])
def test_trainer_reports_a_leak_and_memory_rows(tiny_config, tmp_path, leaky):
    config = tiny_config(
        "memory.every_steps=10",
        "memory.leak_every_steps=4",
        "memory.leak_warmup_steps=4",
        "memory.leak_window=3",
        "memory.leak_max_overhead=1000",
    )
    summary = tk.Trainer(config, loss_fn=LeakyLoss(leaky), progress=False).fit()
    leaks = [r for r in incidents(tmp_path) if r["kind"] == "leak"]
    assert len(leaks) == (1 if leaky else 0)
    assert summary["incidents"].get("leak", 0) == len(leaks)
    if leaky:
        assert leaks[0]["graph_nodes_per_step"] > 0 and "total_loss += loss" in leaks[0]["message"]
    memory = [r for r in tk.read_metrics(tmp_path / "runs" / "tiny" / "metrics.jsonl") if r["kind"] == "memory"]
    assert [r["step"] for r in memory] == [10, 20, 30, 40, 50, 60] and all(r["rss_bytes"] > 2**20 for r in memory)


def test_the_cheap_leak_signal_is_read_at_most_once_per_signal_min_s():
    now = [0.0]

    class CountingProbe(FakeProbe):
        reads = 0

        def rss_bytes(self):
            CountingProbe.reads += 1
            return self.rss

    detector = LeakDetector(
        warmup_steps=0,
        signal_every_steps=10,
        signal_min_s=0.045,
        max_overhead=0.0,
        reader=CountingProbe(),
        clock=lambda: now[0],
    )
    for step in range(1, 1001):  # 1,000 steps of 1 ms: 100 due by step count, 20 of them 45 ms apart
        now[0] += 0.001
        detector.observe(step)
    assert CountingProbe.reads == 20


def test_read_finite_takes_scalar_tensors_without_stacking_them():
    from torchkeel.distributed import read_finite

    host, finite = read_finite((torch.tensor(2.5), torch.tensor(float("nan"))))
    assert host[0] == 2.5 and math.isnan(host[1]) and finite == [True, False]
    assert read_finite(torch.tensor([1.0, float("inf")])) == ([1.0, float("inf")], [True, False])


def test_rss_is_this_process_own_also_in_a_forked_child():
    from torchkeel.introspect.memory import rss_bytes

    rss_bytes()  # the parent's /proc/self/statm is now open
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child grows by 200 MB and reports how much it saw itself grow
        start = rss_bytes()
        grown = bytearray(200 * 2**20)
        grown[:: 2**12] = b"x" * len(grown[:: 2**12])
        os.write(write, str(rss_bytes() - start).encode())
        os._exit(0)
    os.close(write)
    seen = int(os.read(read, 64).decode())
    os.waitpid(pid, 0)
    assert seen > 150 * 2**20  # read from the parent's file it would be about 0
