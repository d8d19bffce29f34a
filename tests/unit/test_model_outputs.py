"""Outputs as models return them: ``loss.output`` names the loss in a tuple, a dict or a
transformers ``ModelOutput`` (nanoGPT's ``forward(idx, targets)`` returns ``(logits, loss)``),
``loss.logits`` the predictions the metrics score; a step function returns a scalar loss,
``(loss, {metrics})`` or a ``StepOutput`` (a tuple is never guessed at). Every mismatch is one
line, exit 2, naming the key to set."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

import torchkeel as tk
from torchkeel.cli.main import main
from torchkeel.config import load_config
from torchkeel.errors import ConfigError
from torchkeel.train.objective import Objective

VOCAB, BLOCK = 27, 16  # a-z and the space
CPU = torch.device("cpu")
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "its", "bed"]


class CharGPT(nn.Module):
    """nanoGPT's interface: ``forward(idx, targets=None)`` returns ``(logits, loss)``, the loss
    ``None`` without targets."""

    def __init__(self, n_embd: int = 32) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, n_embd), nn.Embedding(BLOCK, n_embd)
        self.mlp = nn.Sequential(nn.LayerNorm(n_embd), nn.Linear(n_embd, 4 * n_embd), nn.GELU())
        self.proj, self.lm_head = nn.Linear(4 * n_embd, n_embd), nn.Linear(n_embd, VOCAB)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        logits = self.lm_head(x + self.proj(self.mlp(x)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-1)


class DictGPT(CharGPT):
    """The same model returning ``{"logits": ..., "loss": ...}``."""

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return {"logits": logits, "loss": loss}


def make_chars(num_train: int = 128, num_val: int = 32):
    """Windows of a seeded stream of words: ``(x, y)`` with ``y`` the next character of ``x``."""
    g = torch.Generator().manual_seed(5)
    words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (2000,), generator=g)]
    stream = torch.tensor([0 if c == " " else ord(c) - 96 for c in " ".join(words)])
    starts = torch.randint(0, len(stream) - BLOCK - 1, (num_train + num_val,), generator=g)
    x = torch.stack([stream[s : s + BLOCK] for s in starts])
    y = torch.stack([stream[s + 1 : s + BLOCK + 1] for s in starts])
    return TensorDataset(x[:num_train], y[:num_train]), TensorDataset(x[num_train:], y[num_train:])


class TokenAccuracy:
    """Next-token accuracy over ``[batch, time, vocab]`` logits: a metric as a user writes one."""

    def __init__(self) -> None:
        self.reset()

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.correct += int((preds.argmax(-1) == target).sum())
        self.total += target.numel()

    def compute(self) -> float:
        return self.correct / self.total

    def reset(self) -> None:
        self.correct, self.total = 0, 0


def char_config(tmp_path, *overrides: str, metrics: bool = True):
    base = {
        "out_dir": str(tmp_path / "runs"),
        "model": {"target": "test_model_outputs:CharGPT"},
        "data": {"target": "test_model_outputs:make_chars", "num_workers": 0},
        "optim": {"lr": 1e-2},
        "train": {"max_epochs": 3, "batch_size": 16, "log_every": 1},
        "metrics": [{"name": "token_acc", "target": "test_model_outputs:TokenAccuracy", "on": ["val", "train"]}]
        if metrics
        else [],
    }
    return load_config(None, list(overrides), base=base)


def own_loss_and_accuracy(model: nn.Module, data) -> tuple[float, float]:
    """The model's own mean loss over ``data`` and its next-token accuracy, by hand."""
    x, y = data.tensors
    model.eval()
    with torch.no_grad():
        out = model(x, y)
    logits, loss = (out["logits"], out["loss"]) if isinstance(out, dict) else out
    return float(loss), float((logits.argmax(-1) == y).float().mean())


@pytest.mark.parametrize(
    "model, overrides",
    [
        ("CharGPT", ["loss.output=1", "loss.logits=0"]),  # nanoGPT's (logits, loss)
        ("DictGPT", ["loss.output=loss"]),  # {"logits", "loss"}: the metrics find "logits" by default
    ],
    ids=["tuple", "dict"],
)
def test_a_model_that_computes_its_loss_trains_on_it_and_its_logits_feed_the_metrics(tmp_path, model, overrides):
    trainer = tk.Trainer(char_config(tmp_path, f"model.target=test_model_outputs:{model}", *overrides), progress=False)
    summary = trainer.fit()
    assert summary["status"] == "completed"
    rows = tk.read_metrics(trainer.run_dir / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5 and 0 <= train[-1]["train_token_acc"] <= 1
    loss, accuracy = own_loss_and_accuracy(trainer.model, make_chars()[1])
    assert summary["val_loss"] == pytest.approx(loss, abs=1e-5)  # model(x, y)'s own loss, not another
    val = [r for r in rows if r["kind"] == "val"][-1]
    assert val["val_token_acc"] == pytest.approx(accuracy, abs=1e-6) and accuracy > 1 / VOCAB


def test_a_model_trained_on_its_own_loss_exports_without_its_targets(tmp_path):
    """Trained as ``model(idx, targets)``, exported as ``model(idx)`` → its logits: a server has no labels."""
    from torchkeel.export import export_run
    from torchkeel.export.formats import load_exported

    config = char_config(tmp_path, "loss.output=1", "loss.logits=0", "train.max_epochs=1", metrics=False)
    trainer = tk.Trainer(config, progress=False)
    trainer.fit()
    meta = export_run(trainer.run_dir, "torchscript", tmp_path / "export")
    assert meta["parity"]["passed"] and [i["name"] for i in meta["inputs"]] == ["input"]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 16, VOCAB]}]
    run = load_exported("torchscript", tmp_path / "export" / meta["file"])
    x = make_chars(4, 0)[0].tensors[0]
    expected, _ = trainer.model.eval()(x)
    assert torch.allclose(torch.as_tensor(run(x.numpy())), expected, atol=1e-5)


def test_keel_train_on_a_model_returning_logits_and_loss_without_loss_output_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "char.yaml"
    config = {
        "out_dir": str(tmp_path / "runs"),
        "model": {"target": "test_model_outputs:CharGPT"},
        "data": {"target": "test_model_outputs:make_chars", "num_workers": 0},
        "train": {"max_steps": 2, "max_epochs": None, "batch_size": 8},
    }
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err, captured.err
    (error,) = [line for line in captured.err.splitlines() if "error" in line]  # beside the start's notes
    assert error.startswith("keel: error: ") and "tuple (Tensor[8, 16, 27] float32, None)" in error  # what came back
    assert "loss.output: 1" in error and "loss.logits: 0" in error  # the keys to set, with their values


def test_metrics_without_the_predictions_name_loss_logits(tmp_path):
    trainer = tk.Trainer(char_config(tmp_path, "loss.output=1", "train.max_steps=1"), progress=False)
    with pytest.raises(ConfigError, match=r"loss\.logits") as caught:
        trainer.fit()
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)


def test_loss_output_beside_a_step_function_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"loss\.output names part of what the model returns.*StepOutput"):
        tk.Trainer(char_config(tmp_path, "loss.output=1", "loss.step_fn=test_model_outputs:sum_and_count"))


def outputs_of(kind: str):
    torch.manual_seed(0)
    model = DictGPT() if kind == "dict" else CharGPT()
    x, y = make_chars(8, 0)[0].tensors
    return model, (x, y)


MISMATCHES = {  # model kind, loss.output, loss.logits -> the one line
    "out-of-range": (
        "tuple",
        2,
        None,
        r"^loss\.output: 2 is out of range: the model returned tuple \(Tensor\[8, 16, 27\] float32, Tensor\[\] "
        r"float32\) \(2 items\); set loss\.output to an index from 0 to 1$",
    ),
    "not-a-scalar": (
        "tuple",
        0,
        None,
        r"^loss\.output: 0 picks Tensor\[8, 16, 27\] float32 from what model\(inputs, targets\) returned, "
        r"tuple .*it must pick the loss, one number \(loss\.output: 1\)$",
    ),
    "a-key-of-a-tuple": ("tuple", "loss", None, r"names a key, but the model returned tuple .*\(loss\.output: 1\)$"),
    "an-index-of-a-dict": (
        "dict",
        1,
        None,
        r"^loss\.output: 1 indexes a tuple or list, but the model returned dict \{logits: Tensor\[8, 16, 27\] "
        r"float32, loss: Tensor\[\] float32\}; name a key instead \(loss\.output: loss\)$",
    ),
    "a-missing-key": ("dict", "nll", None, r"^loss\.output: 'nll' found nothing .*\(loss\.output: loss\)$"),
    "logits-out-of-range": ("tuple", 1, 5, r"^loss\.logits: 5 is out of range"),
}


@pytest.mark.parametrize("kind, output, logits, message", MISMATCHES.values(), ids=MISMATCHES.keys())
def test_each_mismatch_is_one_line_naming_the_key_and_what_the_model_returned(kind, output, logits, message):
    model, batch = outputs_of(kind)
    with pytest.raises(ConfigError, match=message) as caught:
        Objective(nn.CrossEntropyLoss(), output=output, logits=logits)(model, batch, CPU)
    assert caught.value.exit_code == 2


class WithFeatures(CharGPT):
    """Returns ``(logits, features)`` and no loss: the loss is ``loss.target`` on the logits."""

    def forward(self, idx):
        logits, _ = super().forward(idx)
        return logits, logits.mean(dim=-1)


def test_loss_logits_alone_gives_the_loss_target_the_predictions():
    torch.manual_seed(0)
    model, (x, y) = WithFeatures(), make_chars(8, 0)[0].tensors
    token_loss = lambda logits, targets: F.cross_entropy(logits.transpose(1, 2), targets)  # noqa: E731
    out = Objective(token_loss, logits=0)(model, (x, y), CPU)
    assert torch.equal(out.loss, token_loss(model(x)[0], y)) and out.outputs.shape == (8, BLOCK, VOCAB)
    with pytest.raises(ConfigError, match=r"^loss\.target could not take .*tuple \(Tensor\[8, 16, 27\] float32, "):
        Objective(token_loss)(model, (x, y), CPU)


def test_a_transformers_model_output_is_read_by_index_or_name():
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class HFStyle(CharGPT):
        def forward(self, input_ids, labels=None):
            logits, loss = super().forward(input_ids, labels)
            return outputs.CausalLMOutput(loss=loss, logits=logits)

    torch.manual_seed(0)
    model = HFStyle()
    x, y = make_chars(8, 0)[0].tensors
    expected = model(x, y)
    for batch in ({"input_ids": x, "labels": y}, (x, y)):
        for where in (0, "loss"):
            out = Objective(nn.CrossEntropyLoss(), output=where)(model, batch, CPU)
            assert torch.equal(out.loss, expected.loss) and torch.equal(out.outputs, expected.logits)
            assert torch.equal(out.targets, y)
    with pytest.raises(ConfigError, match=r"^loss\.output: 'loss' found nothing .*CausalLMOutput \{logits: Tensor"):
        Objective(nn.CrossEntropyLoss(), output="loss")(model, {"input_ids": x}, CPU)


# Step functions.


def two_tensors(model, batch):
    x, y = batch
    logits, loss = model(x, y)
    return loss, logits  # (loss, logits): once read as (loss_sum, count)


def sum_and_count(model, batch):
    x, y = batch
    logits, _ = model(x)
    return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), reduction="sum"), torch.tensor(y.numel())


def per_sample(model, batch):
    x, y = batch
    logits, _ = model(x)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)


STEP_RESULTS = {
    "loss-logits": (two_tensors, "tuple (Tensor[] float32, Tensor[8, 16, 27] float32)"),
    "sum-count": (sum_and_count, "tuple (Tensor[] float32, Tensor[] int64)"),
}


@pytest.mark.parametrize("step_fn, returned", STEP_RESULTS.values(), ids=STEP_RESULTS.keys())
def test_a_step_function_returning_a_two_tensor_tuple_is_told_to_return_a_step_output(step_fn, returned):
    model, batch = outputs_of("tuple")
    with pytest.raises(ConfigError) as caught:
        Objective(step_fn=step_fn)(model, batch, CPU)
    message = str(caught.value)
    assert f"loss.step_fn returned {returned};" in message
    assert "torchkeel.StepOutput(loss_sum, count=n)" in message and "\n" not in message


def test_a_step_function_returning_a_loss_per_sample_is_named():
    model, batch = outputs_of("tuple")
    with pytest.raises(ConfigError, match=r"loss\.step_fn returned Tensor\[8\] float32: a loss of 8 numbers"):
        Objective(step_fn=per_sample)(model, batch, CPU)


class MaskedTokens(Dataset):
    """Token rows whose real length varies (the rest is padding): a sum loss has a count per batch."""

    def __init__(self, num: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(1, VOCAB, (num, BLOCK), generator=g)
        lengths = torch.randint(1, BLOCK + 1, (num,), generator=g)
        self.mask = (torch.arange(BLOCK)[None, :] < lengths[:, None]).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"tokens": self.x[i], "mask": self.mask[i]}


def make_masked():
    return MaskedTokens(64, 1), MaskedTokens(16, 2)


def masked_sum(model, batch):
    """The loss summed over the real tokens, and their number: weighted by tokens, exactly."""
    tokens, mask = batch["tokens"], batch["mask"]
    logits, _ = model(tokens)
    targets = (tokens * 7 + 3) % VOCAB
    losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none") * mask
    return tk.StepOutput(losses.sum(), count=mask.sum(), logits=logits, targets=targets)


def masked_mean(model, batch):
    """The same loss as a mean over the micro-batch's tokens: weighted by samples (the wrong weight)."""
    out = masked_sum(model, batch)
    return tk.StepOutput(out.loss / out.count, logits=out.logits, targets=out.targets)  # no count: a mean


def trained(tmp_path, name: str, step_fn: str, batch_size: int, accumulate: int):
    config = char_config(
        tmp_path,
        f"name={name}",
        "data.target=test_model_outputs:make_masked",
        f"loss.step_fn=test_model_outputs:{step_fn}",
        f"train.batch_size={batch_size}",
        f"train.accumulate={accumulate}",
        "train.max_epochs=1",
    )
    trainer = tk.Trainer(config, progress=False)
    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["steps"] == 4
    return trainer, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def max_difference(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_a_step_output_with_a_count_weighs_accumulation_by_it(tmp_path):
    """``batch 8 × accumulate 2`` updates like ``batch 16`` for a sum loss over a varying count;
    its logits and targets reach the metrics."""
    big, big_weights = trained(tmp_path, "big", "masked_sum", 16, 1)
    _, small_weights = trained(tmp_path, "small", "masked_sum", 8, 2)
    assert max_difference(big_weights, small_weights) < 1e-6
    val = [r for r in tk.read_metrics(big.run_dir / "metrics.jsonl") if r["kind"] == "val"][-1]
    assert 0 <= val["val_token_acc"] <= 1 and math.isfinite(val["val_loss"])
    # The check can fail: the same loss as a mean per micro-batch is weighted by samples.
    _, mean_big = trained(tmp_path, "mean-big", "masked_mean", 16, 1)
    _, mean_small = trained(tmp_path, "mean-small", "masked_mean", 8, 2)
    assert max_difference(mean_big, mean_small) > 1e-4
