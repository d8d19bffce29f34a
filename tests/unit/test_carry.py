"""State carried across batches (truncated backpropagation through time), as pytorch/examples'
word_language_model carries its LSTM's hidden state: the Trainer and a hand-written loop with
``CarriedState`` equal a plain PyTorch TBPTT loop bitwise, a resume mid-epoch continues the
state, validation carries its own, and the misconfigurations are one-line errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import torchkeel as tk
from torchkeel.train.objective import Objective

VOCAB, BATCH, BPTT, LR = 16, 4, 6, 1.0


def make_stream(num_tokens: int, seed: int) -> torch.Tensor:
    """Random tokens, nine in ten replaced by the token two back plus one: the first targets of
    a chunk depend on the chunk before, which only a carried state sees."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCAB, (num_tokens,), generator=g)
    follows = torch.rand(num_tokens, generator=g) < 0.9
    for i in range(2, num_tokens):
        if follows[i]:
            stream[i] = (stream[i - 2] + 1) % VOCAB
    return stream


class Chunks(Dataset):
    """word_language_model's layout: the stream cut into ``BATCH`` rows (``batchify``), and sample
    ``chunk * BATCH + row`` the ``chunk``-th ``BPTT`` tokens of row ``row`` with their next tokens;
    in order, each batch of ``BATCH`` samples is one chunk, each of its rows a continuing stream."""

    def __init__(self, stream: torch.Tensor) -> None:
        per_row = stream.numel() // BATCH
        self.rows = stream[: per_row * BATCH].view(BATCH, per_row)
        self.num_chunks = -(-(per_row - 1) // BPTT)

    def __len__(self) -> int:
        return self.num_chunks * BATCH

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk, row = divmod(index, BATCH)
        start = chunk * BPTT
        end = min(start + BPTT, self.rows.shape[1] - 1)
        return self.rows[row, start:end], self.rows[row, start + 1 : end + 1]

    def batch(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = zip(*(self[chunk * BATCH + row] for row in range(BATCH)))
        return torch.stack(inputs), torch.stack(targets)


def make_data():
    return Chunks(make_stream(4 * 120 + 1, seed=1)), Chunks(make_stream(4 * 37, seed=2))


class TinyLM(nn.Module):
    def __init__(self, hidden: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor] | None):
        out, hidden = self.rnn(self.embed(tokens), hidden)
        return self.head(out), hidden


def lm_step(model, batch, state):
    inputs, targets = batch
    logits, state = model(inputs, state)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    return tk.StepOutput(loss, state=state)


def reset_step(model, batch):
    """The control: every batch starts from no state."""
    return lm_step(model, batch, None).loss


def two_argument_step(model, batch):
    return lm_step(model, batch, None)


def stateless_step(model, batch, state):
    return lm_step(model, batch, state).loss


def stateful_step(model, batch):
    return lm_step(model, batch, None)


def plain_tbptt(epochs: int) -> tuple[list[float], nn.Module]:
    """A plain PyTorch truncated-BPTT loop, as word_language_model's ``train()`` (SGD, no clipping)."""
    torch.manual_seed(0)
    train, _ = make_data()
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(epochs):
        hidden = None
        for chunk in range(train.num_chunks):
            inputs, targets = train.batch(chunk)
            if hidden is not None:
                hidden = tuple(h.detach() for h in hidden)
            logits, hidden = model(inputs, hidden)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, model


def plain_eval(model: nn.Module, carry: bool) -> float:
    """The mean loss over the validation chunks, the hidden state carried or not."""
    _, val = make_data()
    hidden, losses = None, []
    with torch.no_grad():
        for chunk in range(val.num_chunks):
            inputs, targets = val.batch(chunk)
            logits, state = model(inputs, hidden if carry else None)
            hidden = state
            losses.append(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).item())
    return sum(losses) / len(losses)


def config(tmp_path, *overrides: str):
    return tk.load_config(
        None,
        [
            f"out_dir={tmp_path / 'runs'}",
            "model.target=test_carry:TinyLM",
            "data.target=test_carry:make_data",
            "data.shuffle=false",
            "data.num_workers=0",
            "loss.step_fn=test_carry:lm_step",
            "train.carry.enabled=true",
            f"train.batch_size={BATCH}",
            "train.max_epochs=2",
            "train.log_every=1",
            "train.clip_grad_norm=null",
            "optim.name=sgd",
            f"optim.lr={LR}",
            "schedule.decay=constant",
            *overrides,
        ],
    )


def fit(cfg, **kwargs):
    trainer = tk.Trainer(cfg, progress=False, **kwargs)
    summary = trainer.fit()
    assert summary["status"] == "completed"
    rows = tk.read_metrics(trainer.run_dir / "metrics.jsonl")
    return trainer, [r["loss"] for r in rows if r["kind"] == "train"], summary


def test_the_trainer_and_a_hand_loop_with_carried_state_equal_a_plain_tbptt_loop(tmp_path):
    expected, reference = plain_tbptt(epochs=2)
    trainer, losses, _ = fit(config(tmp_path))
    assert losses == expected
    for name, value in reference.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], value), name

    # The component alone, in a hand-written loop.
    torch.manual_seed(0)
    train, _ = make_data()
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    carry = tk.CarriedState(lm_step)
    objective, hand = Objective(step_fn=carry), []
    for _ in range(2):
        carry.start_epoch()
        for chunk in range(train.num_chunks):
            loss = objective(model, train.batch(chunk), torch.device("cpu")).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            hand.append(loss.item())
    assert hand == expected
    assert all(not t.requires_grad for t in carry.train_state)  # detached after each micro-batch


def test_carried_state_differs_from_a_reset_every_batch(tmp_path):
    _, carried, with_state = fit(config(tmp_path, "name=carried"))
    _, reset, without = fit(
        config(tmp_path, "name=reset", "train.carry.enabled=false", "loss.step_fn=test_carry:reset_step")
    )
    assert carried[0] == reset[0]  # the first batch starts from no state in both
    assert carried[1:] != reset[1:]
    # A chunk's first targets depend on the chunk before: only the carried state can learn them.
    assert with_state["val_loss"] < without["val_loss"]


def test_a_resume_continues_the_carried_state_bitwise(tmp_path):
    straight, losses, _ = fit(config(tmp_path, "name=straight", "checkpoint.every_steps=1", "checkpoint.keep_last=100"))
    for stop_at in (13, 20, 27):  # mid-epoch, the first epoch's end, mid-epoch again (20 steps an epoch)
        saved = tk.read_checkpoint(straight.store.path_for(stop_at))
        assert saved.state["carry"][0]["train"] is not None
        resumed, rest, _ = fit(config(tmp_path, f"name=resumed{stop_at}"), resume=saved.path)
        assert rest == losses[stop_at:], stop_at
        for name, value in straight.model.state_dict().items():
            assert torch.equal(resumed.model.state_dict()[name], value), (stop_at, name)


@pytest.mark.parametrize("carry_eval", [True, False])
def test_validation_carries_its_own_state(tmp_path, carry_eval):
    trainer, losses, summary = fit(config(tmp_path, f"train.carry.eval={carry_eval}", "train.max_epochs=1"))
    assert summary["val_loss"] == pytest.approx(plain_eval(trainer.model, carry=carry_eval), rel=1e-6)
    # Validations in the middle of the epoch leave the training stream where it was.
    _, interrupted, often = fit(
        config(tmp_path, "name=often", f"train.carry.eval={carry_eval}", "train.max_epochs=1", "train.val_every=7")
    )
    assert interrupted == losses
    assert often["val_loss"] == pytest.approx(plain_eval(trainer.model, carry=carry_eval), rel=1e-6)


@pytest.mark.parametrize(
    "overrides, at, message",
    [
        (["loss.step_fn=null"], "config", "train.carry.enabled is true but loss.step_fn is not set"),
        (["data.shuffle=true"], "config", "needs the batches in their order; set data.shuffle: false"),
        (["loss.step_fn=test_carry:two_argument_step"], "build", r"must take \(model, batch, state\)"),
        (["loss.step_fn=test_carry:stateless_step"], "fit", "returned Tensor; return torchkeel.StepOutput"),
        (
            ["train.carry.enabled=false", "loss.step_fn=test_carry:stateful_step"],
            "fit",
            "returned a state but train.carry.enabled is false",
        ),
    ],
)
def test_carry_misconfigurations_are_one_line_config_errors(tmp_path, overrides, at, message):
    cfg = None
    with pytest.raises(tk.ConfigError, match=message) as caught:
        cfg = config(tmp_path, *overrides).validate()
        trainer = tk.Trainer(cfg, progress=False)
        assert at != "build"
        trainer.fit()
    assert at == "config" or cfg is not None
    assert "\n" not in str(caught.value) and "train.carry" in str(caught.value)


POISON = {"calls": 0, "at": 5}


def poisoned_step(model, batch, state):
    """``lm_step``, whose 5th training call hands on a NaN state (an overflow in the recurrence)."""
    out = lm_step(model, batch, state)
    if model.training:
        POISON["calls"] += 1
        if POISON["calls"] == POISON["at"]:
            out.state = tuple(h * float("nan") for h in out.state)
    return out


def test_a_step_the_guard_skips_does_not_hand_its_state_on(tmp_path):
    POISON["calls"] = 0
    trainer = tk.Trainer(config(tmp_path, "loss.step_fn=test_carry:poisoned_step"), progress=False)
    summary = trainer.fit()
    assert summary["status"] == "completed"
    incidents = tk.read_metrics(trainer.run_dir / "incidents.jsonl")
    skipped = [r["step"] for r in incidents if r["kind"] == "nonfinite"]
    assert skipped == [6]  # the step that met the NaN state; the next starts from None
