"""``keel lr-find``: rising rates on a copy, a suggestion before divergence, the plot, and
``--apply`` editing only the config's ``optim.lr``."""

from __future__ import annotations

import math

import hand_written_loop
import pytest
import torch
import yaml

import torchkeel as tk
from torchkeel.cli.main import main
from torchkeel.train.lrfind import find_lr, steepest


def test_the_test_stops_at_divergence_suggests_a_rate_before_it_and_gives_the_weights_back(tiny_config):
    # Weights from a seed of the test's own: a ReLU network whose units all die under a huge rate
    # survives to max_lr (1 seed in 8 here), and the weights must not depend on the tests before.
    torch.manual_seed(2)
    model = hand_written_loop.make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = tiny_config("optim.name=sgd", "train.clip_grad_norm=null")
    found = find_lr(config, min_lr=1e-4, max_lr=1e4, steps=60, model=model)
    assert "diverged" in found.stopped or "non-finite" in found.stopped
    assert len(found.lrs) < 60 and found.lrs == sorted(found.lrs)  # stopped early, rates rising
    lowest = found.lrs[min(range(len(found.smoothed)), key=found.smoothed.__getitem__)]
    assert found.suggestion is not None and 1e-4 < found.suggestion < lowest
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_suggestion_is_the_steepest_fall_of_the_curve():
    lrs = [10 ** (-6 + 5 * i / 99) for i in range(100)]
    drop = [2.0 - 1.5 / (1 + math.exp(-3 * (math.log10(lr) + 3))) for lr in lrs]  # falls fastest at 1e-3
    curve = [d if lr < 0.03 else d + 50 * (lr - 0.03) for d, lr in zip(drop, lrs)]  # then blows up
    assert steepest(lrs, curve) == pytest.approx(1e-3, rel=0.15)
    assert steepest(lrs, [1.0] * 100) is None and steepest(lrs[:5], drop[:5]) is None


@pytest.mark.parametrize(
    "optim_text",
    [
        "optim: {lr: 3.0e-3, name: adamw}   # keep me\n",
        "optim:\n  name: adamw\n  lr: 3.0e-3   # keep me\n",
        "optim:   # keep me\n  name: adamw\n",
        "",
    ],
)
def test_keel_lr_find_applies_its_suggestion_to_the_config_and_nothing_else(tmp_path, monkeypatch, capsys, optim_text):
    monkeypatch.chdir(tmp_path)
    text = (
        "# the team's config\nname: tiny\nout_dir: runs\n"
        "model: {target: hand_written_loop:make_model}\ndata: {target: hand_written_loop:make_data}\n"
        + optim_text
        + "train: {batch_size: 16}\n"
    )
    (tmp_path / "cfg.yaml").write_text(text)
    assert main(["lr-find", "cfg.yaml", "--steps", "30", "--min", "1e-5", "--max", "10", "--apply"]) == 0
    out = capsys.readouterr().out
    rate = float(out.split("optim.lr=")[1].split()[0])
    assert tk.load_config(tmp_path / "cfg.yaml").optim.lr == rate
    edited = (tmp_path / "cfg.yaml").read_text()
    assert edited.startswith("# the team's config\n") and ("# keep me" in edited) == ("# keep me" in optim_text)
    assert yaml.safe_load(edited)["train"] == {"batch_size": 16}
    assert (tmp_path / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "runs").exists()  # a copy was trained: no run directory


def test_a_range_the_wrong_way_round_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(
        "model: {target: hand_written_loop:make_model}\ndata: {target: hand_written_loop:make_data}\n"
    )
    assert main(["lr-find", "cfg.yaml", "--min", "1", "--max", "0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["keel: error: the range test needs 0 < --min < --max, got 1 and 0.1"]
