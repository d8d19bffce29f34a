"""A short run of the tokens example (``examples/tokens``): a strict transformers-shaped model
on padded dict batches, for the export and serving tests."""

from __future__ import annotations

from pathlib import Path

import torchkeel as tk


def train_tokens(out: Path, name: str = "tokens", *overrides: str) -> Path:
    """Train ``tokens:TinyLM`` on 256 sequences for one epoch into ``out/name``; returns the run directory."""
    config = tk.load_config(
        None,
        [
            f"out_dir={out}",
            f"name={name}",
            "model.target=tokens:TinyLM",
            "data.target=tokens:make_data",
            "data.args={num_train: 256, num_val: 64}",
            "data.collate=pad",
            "data.num_workers=0",
            "loss.count_key=labels",
            "loss.shift_labels=true",
            "train.max_epochs=1",
            "train.batch_size=16",
            *overrides,
        ],
    )
    tk.Trainer(config, progress=False).fit()
    return out / name
