"""torchmetrics in validation: values equal a reference implementation on the same predictions,
checkpoints can be ranked by them, and config mistakes are one-line errors naming the key."""

from __future__ import annotations

import json

import pytest
import torch
from hand_written_loop import make_data
from sklearn.metrics import f1_score
from torchmetrics.classification import MulticlassAccuracy

import torchkeel as tk
from torchkeel.checkpoint import CheckpointStore
from torchkeel.errors import ConfigError
from torchkeel.report import build_report as tk_report
from torchkeel.train.metricset import MetricSet
from torchkeel.train.step import StepSettings, train_step

F1 = "{name: f1, target: 'torchmetrics.classification:MulticlassF1Score', args: {num_classes: 4}}"
# Two features for four classes: the classes overlap, so F1 stays well below 1 and moves.
HARD = [
    "data.args={num_features: 2}",
    "model.args={num_features: 2}",
    "model.target=hand_written_loop:make_model",
    "data.target=hand_written_loop:make_data",
]


def val_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "val"]


def test_f1_equals_sklearn_on_the_same_predictions(tiny_config):
    config = tiny_config(*HARD, f"metrics=[{F1}]", "train.max_epochs=3")
    trainer = tk.Trainer(config, progress=False)
    summary = trainer.fit()
    rows = val_rows(trainer.run_dir)
    assert len(rows) == 3 and all("val_f1" in r and "val_accuracy" not in r for r in rows)
    x, y = make_data(num_features=2)[1].tensors
    trainer.model.eval()
    with torch.inference_mode():
        predicted = trainer.model(x).argmax(dim=1)
    expected = f1_score(y.numpy(), predicted.numpy(), average="macro")
    assert 0.2 < expected < 0.99
    assert rows[-1]["val_f1"] == pytest.approx(expected, abs=1e-6)
    assert summary["val_f1"] == rows[-1]["val_f1"]
    report = tk_report(trainer.run_dir)
    assert "val_f1" in report.path.read_text() and any(p.stem == "val_metrics" for p in report.images)


def test_checkpoint_monitor_keeps_the_best_f1(tiny_config):
    config = tiny_config(
        *HARD,
        f"metrics=[{F1}]",
        "train.max_epochs=4",
        "train.val_every=5",
        "checkpoint.every_steps=5",
        "checkpoint.monitor=val_f1",
        "checkpoint.mode=max",
        "checkpoint.keep_last=1",
        "checkpoint.save_top_k=1",
        "optim.lr=0.05",
    )
    trainer = tk.Trainer(config, progress=False)
    trainer.fit()
    by_step = {r["step"]: r["val_f1"] for r in val_rows(trainer.run_dir) if r["step"] % 5 == 0}
    assert len(set(by_step.values())) > 2  # the metric moved: the choice means something
    best_step = max(by_step, key=lambda s: (by_step[s], -s))
    kept = {step for step, _ in CheckpointStore(trainer.run_dir / "checkpoints").steps()}
    assert best_step in kept
    assert len(kept) <= 2


def test_metric_set_computes_and_resets():
    metrics = MetricSet({"acc": MulticlassAccuracy(num_classes=3, average="micro")}, torch.device("cpu"))
    metrics.update(torch.tensor([[0.9, 0.1, 0.0], [0.1, 0.8, 0.1]]), torch.tensor([0, 2]))
    assert metrics.compute() == {"val_acc": 0.5}
    metrics.update(torch.tensor([[0.9, 0.1, 0.0]]), torch.tensor([0]))
    assert metrics.compute() == {"val_acc": 1.0}


@pytest.mark.parametrize(
    "entry, key",
    [
        ("{name: 'val f1', target: 'torchmetrics:Accuracy'}", "metrics[0].name"),
        ("{name: f1}", "metrics[0].target"),
        ("{name: loss, target: 'torchmetrics:Accuracy'}", "metrics[0].name"),
        (
            "{name: f1, target: 'torchmetrics.classification:MulticlassF1Score', args: {num_klasses: 4}}",
            "metrics[0].args",
        ),
        ("{name: f1, target: 'torch.nn:Linear', args: {in_features: 2, out_features: 2}}", "metrics[0].target"),
    ],
)
def test_metric_config_errors_name_the_key(tiny_config, entry, key):
    with pytest.raises(ConfigError) as err:
        tk.Trainer(tiny_config(f"metrics=[{entry}]"), progress=False)
    assert key in str(err.value)


def test_without_metrics_classification_keeps_val_accuracy(tiny_config):
    trainer = tk.Trainer(tiny_config(), progress=False)
    assert "val_accuracy" in trainer.fit()


def test_train_metrics_cover_the_steps_between_logged_rows(tiny_config):
    entry = (
        "{name: acc, target: 'torchmetrics.classification:MulticlassAccuracy', "
        "args: {num_classes: 4, average: micro}, on: [val, train]}"
    )
    trainer = tk.Trainer(
        tiny_config(*HARD, f"metrics=[{entry}]", "train.max_epochs=1", "train.log_every=5", "data.shuffle=false"),
        progress=False,
    )
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    assert train_rows and all(0 <= r["train_acc"] <= 1 for r in train_rows)
    assert "val_acc" in val_rows(trainer.run_dir)[-1]
    # By hand: the same model, data and steps (a Trainer built the same way, driven by train_step),
    # with the metric fed what each step saw; the first row covers steps 1 to 5.
    again = tk.Trainer(
        tiny_config(*HARD, "name=by-hand", "train.max_epochs=1", "train.log_every=5", "data.shuffle=false"),
        progress=False,
    )
    metric = MulticlassAccuracy(num_classes=4, average="micro")
    counted = []

    def on_outputs(outputs, target):
        metric.update(outputs, target)
        counted.append(int(target.shape[0]))

    for i, batch in enumerate(again.train_loader.epoch(0)):
        if i == 5:
            break
        train_step(
            again.forward_model,
            again.optimizer,
            [batch],
            again.objective,
            StepSettings(
                params=again.params,
                precision=again.precision,
                device=again.device,
                clip_grad_norm_max=1.0,
                scheduler=again.scheduler,
                on_outputs=on_outputs,
            ),
        )
    assert sum(counted) == 5 * 16
    assert train_rows[0]["train_acc"] == pytest.approx(metric.compute().item(), abs=1e-6)
