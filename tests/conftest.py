from __future__ import annotations

import os

import pytest
import torch

from torchkeel.config import load_config


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    """``num_workers: auto`` caches its trials under $XDG_CACHE_HOME: not in the user's home
    (subprocesses inherit it)."""
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if previous is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = previous


@pytest.fixture(autouse=True, scope="session")
def _outside_any_slurm_job():
    """A suite run inside a Slurm batch job: the keel train processes the tests stop with SIGTERM
    must not ask Slurm to requeue the suite's own job (tests that want a job id set their own)."""
    job = os.environ.pop("SLURM_JOB_ID", None)
    yield
    if job is not None:
        os.environ["SLURM_JOB_ID"] = job


@pytest.fixture(autouse=True)
def _one_thread():
    # Identical results between two runs in one process need the same thread count; tests also
    # share 2 cores with each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_config(tmp_path):
    """A config for the synthetic data and MLP of examples/hand_written_loop.py."""

    def make(*overrides: str):
        base = {
            "name": "tiny",
            "out_dir": str(tmp_path / "runs"),
            "model": {"target": "hand_written_loop:make_model"},
            "data": {"target": "hand_written_loop:make_data"},
            "optim": {"lr": 3e-3},
            "train": {"max_epochs": 2, "batch_size": 16, "log_every": 1},
        }
        return load_config(None, list(overrides), base=base)

    return make


def train_tiny(out_dir, steps: int = 20, *overrides: str):
    """A short real run of the example's model and data into ``out_dir/tiny``; returns the Trainer."""
    import torchkeel as tk

    config = load_config(
        None,
        [
            f"out_dir={out_dir}",
            "name=tiny",
            "model.target=hand_written_loop:make_model",
            "data.target=hand_written_loop:make_data",
            "train.max_epochs=null",
            f"train.max_steps={steps}",
            *overrides,
        ],
    )
    trainer = tk.Trainer(config, progress=False)
    trainer.fit()
    return trainer
