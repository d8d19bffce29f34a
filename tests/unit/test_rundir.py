from __future__ import annotations

import pytest

from torchkeel.errors import RunDirError
from torchkeel.train.rundir import prepare_run_dir


def test_existing_run_is_never_silently_overwritten(tmp_path):
    run, _ = prepare_run_dir(tmp_path, "x")
    (run / "config.yaml").write_text("name: x\n")
    with pytest.raises(
        RunDirError,
        match="run directory '.*x' already exists; continue it with --resume auto, choose another name .* --overwrite",
    ):
        prepare_run_dir(tmp_path, "x")
    assert (run / "config.yaml").exists()
    _, previous = prepare_run_dir(tmp_path, "x", overwrite=True)
    assert not (run / "config.yaml").exists() and (previous.aside / "config.yaml").exists()
    previous.restore()
    assert (run / "config.yaml").exists() and not previous.aside.exists()


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(RunDirError, match="not a torchkeel run directory"):
        prepare_run_dir(tmp_path, "home", overwrite=True)
    assert (tmp_path / "home" / "thesis.tex").read_text() == "precious"


def test_an_empty_directory_is_used(tmp_path):
    (tmp_path / "empty").mkdir()
    assert prepare_run_dir(tmp_path, "empty") == (tmp_path / "empty", None)


def test_a_run_set_aside_by_a_killed_attempt_is_kept_over_that_attempt(tmp_path):
    run, _ = prepare_run_dir(tmp_path, "x")
    (run / "config.yaml").write_text("good")
    prepare_run_dir(tmp_path, "x", overwrite=True)  # ... and the new run is killed before a checkpoint
    (run / "config.yaml").write_text("attempt")
    _, previous = prepare_run_dir(tmp_path, "x", overwrite=True)
    assert (previous.aside / "config.yaml").read_text() == "good" and not (run / "config.yaml").exists()
