"""Accumulation equivalence: accumulate=4 × batch 16 updates exactly like batch 64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchkeel as tk
from torchkeel.train.objective import Objective

NUM_SAMPLES = 232  # batch 64: 64, 64, 64, 40 — batch 16 × 4: the last group is 16, 16, 8


def dataset():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(NUM_SAMPLES, 12, generator=g)
    y = torch.randint(0, 3, (NUM_SAMPLES,), generator=g)
    return TensorDataset(x, y)


def train(model, optimizer, batch_size, accumulate, epochs=2):
    loader = tk.EpochLoader(dataset(), batch_size, seed=3)
    params = list(model.parameters())
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    for epoch in range(epochs):
        for group in tk.iter_groups(loader.epoch(epoch), accumulate):
            tk.train_step(
                model,
                optimizer,
                group,
                nn.functional.cross_entropy,
                tk.StepSettings(params=params, precision=tk.Precision(), device=torch.device("cpu")),
            )
    return len(steps)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ],
    ids=["sgd", "adamw"],
)
def test_accumulate_4_of_16_equals_batch_64(make_optimizer):
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3)).double().float()
    small = copy.deepcopy(big)
    steps_big = train(big, make_optimizer(big.parameters()), batch_size=64, accumulate=1)
    steps_small = train(small, make_optimizer(small.parameters()), batch_size=16, accumulate=4)
    assert steps_big == steps_small == 8  # exactly one optimizer step per group, short group included
    for (name, a), b in zip(big.named_parameters(), small.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"parameter {name} differs")


def test_naive_accumulation_would_fail_this_check():
    """The same comparison catches an unweighted sum (the test is able to fail)."""
    torch.manual_seed(0)
    a = nn.Linear(12, 3)
    b = copy.deepcopy(a)
    data = dataset()
    x, y = data.tensors
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    nn.functional.cross_entropy(a(x[:64]), y[:64]).backward()
    opt_a.step()
    for i in range(4):  # mean losses summed without dividing by the group size
        nn.functional.cross_entropy(b(x[16 * i : 16 * (i + 1)]), y[16 * i : 16 * (i + 1)]).backward()
    opt_b.step()
    assert (a.weight - b.weight).abs().max() > 1e-3


def test_groups_and_step_counts():
    assert [len(g) for g in tk.iter_groups(range(10), 4)] == [4, 4, 2]
    assert tk.steps_per_epoch(10, 4) == 3
    assert tk.total_steps(10, 4, max_epochs=3, max_steps=None) == 9
    assert tk.total_steps(10, 4, max_epochs=3, max_steps=5) == 5
    assert tk.total_steps(10, 4, max_epochs=None, max_steps=50) == 50


@pytest.mark.parametrize("summed", [False, True])
def test_the_whole_batch_step_equals_the_general_loop_bitwise(summed):
    """One micro-batch in one process takes a shorter path through train_step; it must give the
    general loop's loss, metrics and weights exactly (``micro_batch_size`` = the batch forces the loop)."""

    def step_fn(model, batch):
        x, y = batch
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        if summed:
            return tk.StepOutput(losses.sum(), count=torch.tensor(float(len(y))), metrics={"top": losses.max()})
        return losses.mean(), {"top": losses.max()}

    torch.manual_seed(3)
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    results = []
    for micro_batch_size in (None, 16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        params = list(model.parameters())
        result = tk.train_step(
            model,
            optimizer,
            [batch],
            Objective(step_fn=step_fn),
            tk.StepSettings(
                params=params, precision=tk.Precision(), device=torch.device("cpu"), clip_grad_norm_max=1.0
            ),
            micro_batch_size=micro_batch_size,
        )
        results.append((result, [p.detach().clone() for p in params]))
    (fast, fast_weights), (loop, loop_weights) = results
    assert torch.equal(fast.loss, loop.loss) and torch.equal(fast.grad_norm, loop.grad_norm)
    assert torch.equal(fast.metrics["top"], loop.metrics["top"])
    assert all(torch.equal(a, b) for a, b in zip(fast_weights, loop_weights))


def test_lookahead_times_its_reads_after_the_first(monkeypatch):
    """The Trainer's wait for data is what Lookahead spends reading: each later group's read,
    taken once; the first read (filling the pipeline) is left out."""
    import types

    from torchkeel.train import accumulate

    now = [0.0]
    monkeypatch.setattr(accumulate, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def groups():
        for cost in (5.0, 1.0, 2.0):  # seconds each read "takes"
            now[0] += cost
            yield [cost]

    ahead = accumulate.Lookahead(groups())
    waits = []
    for group, is_last in ahead:
        waits.append((group, is_last, ahead.take_wait()))
    assert waits == [([5.0], False, 1.0), ([1.0], False, 2.0), ([2.0], True, 0.0)]


class CountingSGD(torch.optim.SGD):
    """An optimizer with a zero_grad of its own, which clear_grads must call."""

    calls = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        CountingSGD.calls += 1
        super().zero_grad(set_to_none)


def test_clear_grads_sets_every_optimized_gradient_to_none_and_respects_the_optimizers_own():
    from torch.profiler import ProfilerActivity, profile

    from torchkeel.train.step import clear_grads

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    frozen = nn.Parameter(torch.ones(2))  # not optimized: its gradient stays, as zero_grad leaves it
    frozen.grad = torch.ones(2)
    first, second = list(model[0].parameters()), list(model[1].parameters())
    optimizer = torch.optim.AdamW([{"params": first}, {"params": second, "lr": 0.1}])
    model(torch.randn(5, 4)).sum().backward()
    clear_grads(optimizer)
    assert all(p.grad is None for p in model.parameters()) and frozen.grad is not None

    own = CountingSGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    clear_grads(own)
    assert CountingSGD.calls == 1 and all(p.grad is None for p in model.parameters())

    model(torch.randn(5, 4)).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        clear_grads(optimizer)  # under a profiler: torch's zero_grad, whose range the trace shows
    assert any("zero_grad" in event.name for event in trace.events())
    assert all(p.grad is None for p in model.parameters())
