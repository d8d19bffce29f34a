"""Step functions for batches of any shape, and count-weighted accumulation: ``batch 16 ×
accumulate 4`` equals ``batch 64 × 1`` when the loss is a mean over a varying number of tokens."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import torchkeel as tk
from torchkeel.data import PadCollate
from torchkeel.train.objective import Objective
from torchkeel.train.precision import Precision

VOCAB = 20


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def _token_losses(model, batch):
    logits = model(batch["tokens"])
    target = (batch["tokens"] * 7 + 3) % VOCAB
    losses = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    return losses * batch["attention_mask"], batch["attention_mask"].sum()


def token_mean(model, batch):
    """A mean over the batch's real tokens, with a metric."""
    losses, count = _token_losses(model, batch)
    return losses.sum() / count, {"tokens": count.float()}


def token_sum(model, batch):
    """The same loss as a sum and its count: the weights come from the step function."""
    losses, count = _token_losses(model, batch)
    return tk.StepOutput(losses.sum(), count=count)


def sequences(num: int, seed: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    return [{"tokens": torch.from_numpy(rng.integers(0, VOCAB, size=int(n)))} for n in rng.integers(1, 30, size=num)]


def train(objective, optimizer_name: str, micro: int, steps=3, num=60) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TokenModel()
    params = list(model.parameters())
    optimizer = (
        torch.optim.SGD(params, lr=0.5)
        if optimizer_name == "sgd"
        else torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    )
    collate = PadCollate(lengths_key="lengths")
    for step in range(steps):
        samples = sequences(num, seed=step)  # 60 = 16 + 16 + 16 + 12: a short last micro-batch
        group = [collate(samples[i : i + micro]) for i in range(0, num, micro)]
        tk.train_step(
            model,
            optimizer,
            group,
            objective,
            tk.StepSettings(params=params, precision=Precision("cpu"), device=torch.device("cpu")),
        )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_difference(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@pytest.mark.parametrize(
    "objective",
    [Objective(step_fn=token_mean, count_key="lengths"), Objective(step_fn=token_sum)],
    ids=["count_key", "sum_and_count"],
)
def test_token_weighted_accumulation_equals_the_big_batch(optimizer_name, objective):
    big = train(objective, optimizer_name, micro=60)
    accumulated = train(objective, optimizer_name, micro=16)
    assert max_difference(big, accumulated) < 1e-6


def test_weighting_by_samples_instead_would_be_wrong():
    """The check above can fail: the HF-Trainer bug (each micro-batch's token mean weighted by samples)."""
    by_samples = Objective(step_fn=token_mean)
    big = train(by_samples, "sgd", micro=60)
    assert max_difference(big, train(by_samples, "sgd", micro=16)) > 1e-4


def test_a_missing_count_key_names_the_keys_there_are():
    with pytest.raises(tk.DataError, match=r"count_key='num_tokens'.*tokens, attention_mask, lengths"):
        Objective(step_fn=token_mean, count_key="num_tokens").weight(PadCollate(lengths_key="lengths")(sequences(2, 0)))


class Sequences(torch.utils.data.Dataset):
    def __init__(self, num: int) -> None:
        self.items = sequences(num, seed=9)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def make_sequences():
    return Sequences(96), Sequences(32)


def test_the_trainer_with_a_step_function_dict_batches_and_pad_collate(tmp_path):
    config = tk.load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "model.target=test_objective:TokenModel",
            "data.target=test_objective:make_sequences",
            "data.collate=pad",
            "data.lengths_key=lengths",
            "data.bucket_by=tokens",
            "data.num_workers=0",
            "loss.step_fn=test_objective:token_mean",
            "loss.count_key=lengths",
            "train.batch_size=16",
            "train.accumulate=2",
            "train.max_epochs=2",
            "train.log_every=1",
        ],
    )
    summary = tk.Trainer(config, progress=False).fit()
    assert summary["status"] == "completed" and summary["steps"] == 6 and "val_loss" in summary
    rows = tk.read_metrics(tmp_path / "run" / "metrics.jsonl")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert all(r["tokens"] > 0 for r in train_rows)  # the step function's metric, logged
    val = [r for r in rows if r["kind"] == "val"][-1]
    assert val["val_tokens"] > 0 and val["val_loss"] == summary["val_loss"]


def test_a_label_count_key_counts_the_labels_a_token_mean_divides_by():
    batch = PadCollate()(
        [
            {"input_ids": torch.arange(3), "labels": torch.tensor([5, -100, 7])},
            {"input_ids": torch.arange(5), "labels": torch.arange(5)},
        ]
    )
    assert batch["labels"].tolist() == [[5, -100, 7, -100, -100], [0, 1, 2, 3, 4]]
    assert Objective(nn.functional.cross_entropy, count_key="labels").weight(batch) == 7.0  # 2 + 5
    assert Objective(nn.functional.cross_entropy, count_key="labels", shift_labels=True).weight(batch) == 5.0  # 1 + 4
    assert Objective(nn.functional.cross_entropy, count_key="labels", ignore_index=7).weight(batch) == 9.0
    assert Objective(nn.functional.cross_entropy, count_key="attention_mask").weight(batch) == 8.0  # summed


class StrictLM(nn.Module):
    """A transformers-shaped model with a strict signature: any key it does not name is an error."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask, labels=None):
        logits = self.head(torch.tanh(self.embed(input_ids))) * attention_mask[..., None]
        loss = None if labels is None else nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def test_a_dict_batch_is_model_of_the_batch_and_its_loss():
    batch = PadCollate()(
        [
            {"input_ids": torch.arange(3), "labels": torch.arange(3)},
            {"input_ids": torch.arange(5), "labels": torch.arange(5)},
        ]
    )
    model = StrictLM()
    out = Objective(nn.CrossEntropyLoss())(model, batch, torch.device("cpu"))
    assert torch.equal(out.loss, model(**batch)["loss"]) and out.outputs.shape == (2, 5, VOCAB)
    with pytest.raises(tk.ConfigError, match=r"without a loss; put the labels in the batch.*set loss\.output"):
        Objective(nn.CrossEntropyLoss())(
            model, {k: batch[k] for k in ("input_ids", "attention_mask")}, torch.device("cpu")
        )


def test_a_step_function_that_returns_something_else_is_named():
    with pytest.raises(tk.ConfigError, match="loss.step_fn returned str"):
        Objective(step_fn=lambda model, batch: "loss")(nn.Identity(), {"x": torch.ones(1)}, torch.device("cpu"))


def test_the_default_objective_is_unchanged_for_pairs():
    model, batch = nn.Linear(3, 2), (torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1]))
    out = Objective(nn.functional.cross_entropy)(model, batch, torch.device("cpu"))
    assert torch.equal(out.loss, nn.functional.cross_entropy(model(batch[0]), batch[1]))
    assert Objective(nn.functional.cross_entropy).weight(copy.deepcopy(batch)) == 5.0


def test_label_checks_cover_class_losses_and_leave_other_layouts_alone():
    from torchkeel.train.objective import LabelOutOfRange, check_labels

    logits = torch.zeros(2, 5, 7)  # [batch, classes, positions] for cross-entropy
    with pytest.raises(LabelOutOfRange, match=r"target 9 is outside \[0, 5\).*sample 1"):
        check_labels(logits, torch.tensor([[0] * 7, [1, 9, 0, 0, 0, 0, 0]]), nn.CrossEntropyLoss())
    check_labels(logits, torch.tensor([[-100] * 7, [4] * 7]), nn.CrossEntropyLoss())  # ignore_index
    check_labels(torch.zeros(2, 7, 5), torch.full((2, 7), 4), lambda out, target: out.sum())  # unknown layout


class RejectsEmpty(nn.Module):
    """Reshapes with -1 as a transformers attention does: a batch of no rows cannot pass."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.norm = nn.BatchNorm1d(8)
        self.seen: list[torch.Tensor] = []

    def forward(self, input_ids, labels):
        self.seen.append(input_ids)
        h = self.embed(input_ids).view(input_ids.shape[0], input_ids.shape[1], -1, 4).flatten(2)
        logits = self.norm(h.mean(1)) @ self.embed.weight.T
        return {"loss": nn.functional.cross_entropy(logits, labels[:, 0]), "logits": logits}


def test_an_empty_share_runs_stand_in_rows_and_adds_nothing():
    torch.manual_seed(0)
    model = RejectsEmpty()
    objective = Objective(nn.functional.cross_entropy)
    ids = torch.randint(0, VOCAB, (4, 6))
    batch = {"input_ids": ids, "labels": ids}
    empty = {k: v[:0] for k, v in batch.items()}
    never = objective(model, empty, torch.device("cpu"))  # before any real batch: rows of zeros
    assert model.seen[-1].shape == (2, 6) and not model.seen[-1].any()
    never.loss.backward()
    assert never.loss.item() == 0 and all(not p.grad.any() for p in model.parameters())
    objective(model, batch, torch.device("cpu"))
    model.zero_grad()
    out = objective(model, empty, torch.device("cpu"))
    assert torch.equal(model.seen[-1], ids[[0, 0]])  # the last real batch's first row, twice
    out.loss.backward()
    assert out.loss.item() == 0 and all(not p.grad.any() for p in model.parameters())


class NormDropout(nn.Module):
    """What a rank whose data ran out must not disturb: batch-norm statistics, dropout's draws."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.drop, self.head = nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.drop(self.norm(x)))


def test_a_stand_in_forward_changes_no_statistics_no_random_draw_and_no_hooks_view():
    model = NormDropout().train()
    seen = []
    model.norm.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    objective = Objective(nn.functional.cross_entropy)
    x, y = torch.randn(16, 8) * 3 + 1, torch.randint(0, 3, (16,))
    objective(model, (x, y), torch.device("cpu")).loss.backward()
    assert seen == [16]
    stats = {k: v.clone() for k, v in model.state_dict().items() if "norm" in k}
    rng = torch.get_rng_state()
    model.zero_grad()
    out = objective(model, (x[:0], y[:0]), torch.device("cpu"))
    out.loss.backward()  # the buffers were put back: the graph's saved tensors are still valid
    assert out.loss.item() == 0 and all(not p.grad.any() for p in model.parameters())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stats.items())  # num_batches_tracked too
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew nothing
    assert seen == [16] and model.training
    objective(model, (x, y), torch.device("cpu"))
    assert seen == [16, 16]  # the hook is back
