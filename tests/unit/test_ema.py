"""Weight averaging: the EMA equals a hand computation, skips what the optimizer did not apply,
survives a kill and resume bitwise, and is what validation and export use."""

from __future__ import annotations

import json

import torch
from keelproc import run_keel
from torch import nn

import torchkeel as tk
from torchkeel.checkpoint import CheckpointStore, read_checkpoint
from torchkeel.export import export_run
from torchkeel.train.ema import WeightAverage, averaged_weights


def hand_ema(history, decay, start=0):
    """e at the first averaged step = the weights; then e = decay * e + (1 - decay) * w."""
    ema = None
    for step, weights in history:
        if step < start:
            continue
        ema = (
            {k: v.clone() for k, v in weights.items()}
            if ema is None
            else {k: decay * ema[k] + (1 - decay) * weights[k] for k in ema}
        )
    return ema


def test_component_matches_the_hand_formula_from_a_hand_written_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = WeightAverage(model, decay=0.8, start_step=2)
    history = []
    for step in range(1, 7):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        ema.update(step)
        history.append((step, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    expected = hand_ema(history, 0.8, start=2)
    for k, v in ema.module.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-6, atol=1e-7)


def test_trainer_ema_equals_the_hand_computation_and_validation_uses_it(tiny_config):
    config = tiny_config(
        "train.ema={decay: 0.9, start_step: 3}",
        "train.max_steps=8",
        "train.max_epochs=null",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=100",
        "checkpoint.every_s=0",
        "checkpoint.async=false",
    )
    trainer = tk.Trainer(config, progress=False)
    summary = trainer.fit()
    store = CheckpointStore(trainer.run_dir / "checkpoints")
    history = sorted((step, read_checkpoint(path).state["model"]) for step, path in store.steps())
    assert [s for s, _ in history] == list(range(1, 9))
    final = averaged_weights(read_checkpoint(max(store.steps())[1]).state["ema"])
    expected = hand_ema(history, 0.9, start=3)
    for k, v in final.items():
        torch.testing.assert_close(v, expected[k], rtol=1e-6, atol=1e-7)
    # The final validation ran on the averaged weights, not on the trained ones.
    val_set = trainer.val_loader
    with_ema = tk.evaluate(
        trainer.ema.module, val_set.epoch(0), nn.functional.cross_entropy, device=torch.device("cpu")
    )
    raw = tk.evaluate(trainer.model, val_set.epoch(0), nn.functional.cross_entropy, device=torch.device("cpu"))
    assert summary["val_loss"] == with_ema["val_loss"] != raw["val_loss"]
    meta = export_run(trainer.run_dir, "torchscript", trainer.run_dir / "export")
    assert meta["weights"] == "ema"
    exported = torch.jit.load(str(trainer.run_dir / "export" / meta["file"]))
    x = torch.randn(3, 32)
    trainer.ema.module.eval()
    torch.testing.assert_close(exported(x), trainer.ema.module(x))


CONFIG = """
name: ema
out_dir: runs
seed: 2
device: cpu
model: {target: hand_written_loop:make_model}
data: {target: hand_written_loop:make_data, num_workers: 0}
train: {max_epochs: null, max_steps: 24, batch_size: 16, log_every: 4, ema: {decay: 0.95}}
checkpoint: {every_steps: 5, every_s: 0}
"""


def test_the_average_survives_a_kill_and_resume_bitwise(tmp_path):
    for name in ("whole", "killed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cfg.yaml").write_text(CONFIG)
    assert run_keel("train", "cfg.yaml", "--no-progress", cwd=tmp_path / "whole").returncode == 0
    assert (
        run_keel(
            "train", "cfg.yaml", "--no-progress", cwd=tmp_path / "killed", TORCHKEEL_TEST_STEP_FAULTS="kill:13"
        ).returncode
        != 0
    )
    resumed = run_keel("train", "cfg.yaml", "--no-progress", "--resume", "auto", cwd=tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    ends = []
    for name in ("whole", "killed"):
        found, _ = CheckpointStore(tmp_path / name / "runs" / "ema" / "checkpoints").latest_valid()
        ends.append(found)
    assert ends[0].step == ends[1].step == 24
    for key, value in ends[0].state["ema"].items():
        assert torch.equal(value, ends[1].state["ema"][key]), key
    rows = [
        json.loads(line) for line in (tmp_path / "killed" / "runs" / "ema" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["kind"] == "resume"] == [10]


def test_a_skipped_step_is_not_averaged_in(tiny_config):
    from test_guards import NaNOnSteps

    config = tiny_config(
        "train.ema={decay: 0.5}",
        "train.max_steps=6",
        "train.max_epochs=null",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=100",
        "checkpoint.every_s=0",
        "checkpoint.async=false",
    )
    trainer = tk.Trainer(config, model=NaNOnSteps([4]), progress=False)
    summary = trainer.fit()
    assert summary["incidents"] == {"nonfinite": 1}
    store = CheckpointStore(trainer.run_dir / "checkpoints")
    states = {step: read_checkpoint(path).state for step, path in store.steps()}
    assert int(states[6]["ema"]["n_averaged"]) == 5  # six steps, one skipped
    e3, e4 = averaged_weights(states[3]["ema"]), averaged_weights(states[4]["ema"])
    for key in e3:
        assert torch.equal(e3[key], e4[key]), key  # step 4 was skipped: the average did not move
