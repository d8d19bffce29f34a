"""The ``val`` section: a validation before the first step, the validation loader's batch, a cap
on the batches a validation reads, and a step cadence whose old name still works."""

from __future__ import annotations

import json

import pytest
import torch
from hand_written_loop import make_data, make_model

import torchkeel as tk
from torchkeel.errors import ConfigError
from torchkeel.train.runlog import read_metrics


def rows_of(trainer, kind):
    return [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if r["kind"] == kind]


class EvalBatches:
    """The batches the model sees in eval mode, one list per validation (a forward pre-hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.validations: list[list[torch.Tensor]] = []
        self.in_validation = False
        model.register_forward_pre_hook(self.seen)

    def seen(self, module, args):
        if module.training:
            self.in_validation = False
            return
        if not self.in_validation:
            self.validations.append([])
            self.in_validation = True
        self.validations[-1].append(args[0].detach().clone())


def test_at_start_logs_the_untrained_models_loss_at_step_0_and_a_resume_does_not_repeat_it(tiny_config):
    first = tk.Trainer(tiny_config("val.at_start=true", "train.max_epochs=1"), progress=False)
    first.fit()
    val = rows_of(first, "val")
    assert [r["step"] for r in val] == [0, first.step]

    tk.seed_everything(0)  # the Trainer's build order: seed, data, model
    _, val_set = make_data()
    untrained = evaluate_all(make_model(), val_set)
    assert val[0]["val_loss"] == pytest.approx(untrained["val_loss"], rel=1e-6)
    assert val[0]["val_loss"] > 2 * val[1]["val_loss"]

    resumed = tk.Trainer(
        tiny_config("val.at_start=true", "train.max_epochs=2"), resume="auto", allow_config_change=True, progress=False
    )
    resumed.fit()
    assert [r["step"] for r in rows_of(resumed, "val")] == [0, first.step, resumed.step]


def test_a_fresh_start_after_a_run_without_checkpoints_logs_step_0_once(tiny_config):
    config = tiny_config("val.at_start=true", "train.max_steps=3", "train.max_epochs=null", "checkpoint.enabled=false")
    for _ in range(2):  # the second finds no checkpoint to resume: it starts again from step 0
        trainer = tk.Trainer(config, resume="auto", progress=False)
        trainer.fit()
    assert [r["step"] for r in rows_of(trainer, "val")] == [0, 3]
    assert [r["step"] for r in rows_of(trainer, "train")] == [1, 2, 3]


def evaluate_all(model, dataset, batch_size=16):
    loader = tk.EpochLoader(dataset, batch_size, shuffle=False)
    return tk.evaluate(model, loader.epoch(0), torch.nn.CrossEntropyLoss(), device=torch.device("cpu"))


def test_val_batch_size_is_the_validation_loaders_batch(tiny_config):
    trainer = tk.Trainer(tiny_config("val.batch_size=40", "train.max_epochs=1"), progress=False)
    seen = EvalBatches(trainer.model)
    trainer.fit()
    assert trainer.val_loader.options.batch_size == 40 and trainer.train_loader.options.batch_size == 16
    assert [[len(b) for b in v] for v in seen.validations] == [[40, 40, 40]]  # 120 validation samples


def test_max_batches_caps_each_validation_at_the_same_first_batches(tiny_config):
    trainer = tk.Trainer(tiny_config("val.max_batches=3", "val.every_steps=10", "train.max_epochs=1"), progress=False)
    seen = EvalBatches(trainer.model)
    trainer.fit()
    assert len(seen.validations) == 3 and all(len(v) == 3 for v in seen.validations)  # of 8 batches
    _, val_set = make_data()
    for batches in seen.validations:
        assert torch.equal(torch.cat(batches), val_set.tensors[0][:48])
    # The logged loss is the mean over those 48 samples, as evaluate computes it from a hand loop.
    model = trainer.model
    capped = tk.evaluate(
        model,
        tk.EpochLoader(val_set, 16, shuffle=False).epoch(0),
        torch.nn.CrossEntropyLoss(),
        device=torch.device("cpu"),
        max_batches=3,
    )
    assert rows_of(trainer, "val")[-1]["val_loss"] == pytest.approx(capped["val_loss"], rel=1e-6)
    assert capped != evaluate_all(model, val_set)


def test_every_steps_validates_on_its_cadence_and_train_val_every_is_its_old_name(tiny_config):
    steps = {}
    for key in ("val.every_steps", "train.val_every"):
        trainer = tk.Trainer(tiny_config(f"{key}=7", "train.max_epochs=2", f"name={key}"), progress=False)
        trainer.fit()
        steps[key] = [r["step"] for r in rows_of(trainer, "val")]
    assert steps["val.every_steps"] == [7, 14, 21, 28, 35, 42, 49, 56, 60]  # 30 steps an epoch; not at 30
    assert steps["train.val_every"] == steps["val.every_steps"]
    with pytest.raises(ConfigError, match="val.every_steps and train.val_every"):
        tiny_config("val.every_steps=7", "train.val_every=5").validate()


@pytest.mark.parametrize(
    "override, key",
    [
        ("val.batch_size=0", "val.batch_size"),
        ("val.max_batches=0", "val.max_batches"),
        ("val.every_steps=-1", "val.every_steps"),
    ],
)
def test_a_val_value_out_of_range_names_its_key(tiny_config, override, key):
    with pytest.raises(ConfigError, match=key):
        tiny_config(override).validate()


def test_keel_train_validates_at_start_from_the_command_line(tmp_path):
    from torchkeel.cli.main import main

    config = tmp_path / "cfg.yaml"
    config.write_text(
        json.dumps(
            {
                "name": "cli",
                "out_dir": str(tmp_path / "runs"),
                "model": {"target": "hand_written_loop:make_model"},
                "data": {"target": "hand_written_loop:make_data"},
                "train": {"max_steps": 3, "max_epochs": None, "batch_size": 16},
                "val": {"at_start": True, "max_batches": 1},
            }
        )
    )
    assert main(["train", str(config), "--no-progress"]) == 0
    val = [r for r in read_metrics(tmp_path / "runs" / "cli" / "metrics.jsonl") if r["kind"] == "val"]
    assert [r["step"] for r in val] == [0, 3]
