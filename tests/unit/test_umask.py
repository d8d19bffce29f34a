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


@pytest.fixture(scope="module")
def text_lm(tmp_path_factory):
    """A transformers causal LM trained on text: every export format applies to it."""
    from textrun import train_text_lm

    pytest.importorskip("transformers")
    return train_text_lm(tmp_path_factory.mktemp("umask-lm"), "lm")


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_every_file_and_folder_of_every_export_format_follows_the_umask(text_lm, tmp_path, umask, mask):
    from torchkeel.export.export import export_pretrained
    from torchkeel.export.triton import write_triton_repo

    os.umask(mask)
    export_pretrained(text_lm, tmp_path / "export-hf")
    for fmt in ("onnx", "torchscript", "torch-export"):
        export_run(text_lm, fmt, out_dir=tmp_path / f"export-{fmt}")
    write_triton_repo(tmp_path / "export-onnx", tmp_path / "triton")
    written = list(tmp_path.rglob("*"))
    assert {"model.safetensors", "tokenizer.json", "model.onnx", "model.pt", "model.pt2", "config.pbtxt"} <= {
        p.name for p in written
    }
    wanted = {True: 0o777 & ~mask, False: 0o666 & ~mask}
    modes = {str(p.relative_to(tmp_path)): (p.is_dir(), stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert {path: oct(mode) for path, (is_dir, mode) in modes.items() if mode != wanted[is_dir]} == {}
