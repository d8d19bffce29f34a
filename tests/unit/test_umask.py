"""Every file torchkeel writes follows the umask, as a plain ``open()`` would: a run's files,
its checkpoints, its profile and an export, under umask 022 (a server running as another user
reads the weights) and 077 (nobody else reads anything)."""

from __future__ import annotations

import os
import stat

import pytest

import torchkeel as tk
from torchkeel.export import export_run


@pytest.fixture
def umask():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_run_checkpoint_profile_and_export_files_follow_the_umask(tiny_config, tmp_path, umask, mask):
    os.umask(mask)
    trainer = tk.Trainer(
        tiny_config("train.max_epochs=1", "profile.steps=[2,3]", "checkpoint.every_steps=5"), progress=False
    )
    assert trainer.fit()["status"] == "completed"
    for fmt in ("onnx", "torchscript"):
        export_run(trainer.run_dir, fmt, out_dir=tmp_path / f"export-{fmt}")
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    names = {p.name for p in written}
    assert {
        "config.yaml",
        "summary.json",
        "manifest.json",
        "model.json",
        "model.safetensors",
        "model.onnx",
        "model.pt",
    } <= names
    assert any(p.parent.name == "profile" and p.name == "summary.json" for p in written)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in written}
    assert {path: mode for path, mode in modes.items() if mode != 0o666 & ~mask} == {}
