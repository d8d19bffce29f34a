"""A small causal LM trained for a few steps on a folder of text files, as a user trains one
(``data.format: text``), for the export and generation tests: cheap enough for unit tests."""

from __future__ import annotations

from pathlib import Path

import yaml

import torchkeel as tk

GPT2_BYTES = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 257}
"""A GPT-2 of one layer over the byte tokenizer's 257 ids."""


def text_folder(root: Path) -> Path:
    """``root/text/{train,val}``: a few short documents each."""
    for split, count in (("train", 6), ("val", 2)):
        (root / "text" / split).mkdir(parents=True, exist_ok=True)
        for n in range(count):
            lines = [f"def f{n}_{i}(x):\n    return x * {i} + {n}\n" for i in range(12)]
            (root / "text" / split / f"doc{n}.txt").write_text("".join(lines))
    return root / "text"


def train_text_lm(
    out: Path, name: str, model: dict | None = None, *overrides: str, tokenizer: str | Path = "byte", steps: int = 2
) -> Path:
    """Train ``model`` (a ``model.hf.config``; default ``GPT2_BYTES``) on ``text_folder(out)`` into
    ``out/name``; returns the run directory."""
    text = text_folder(out)
    config = tk.load_config(
        None,
        [
            f"out_dir={out}",
            f"name={name}",
            "data.format=text",
            f"data.train={text / 'train'}",
            f"data.val={text / 'val'}",
            f"data.tokenizer={tokenizer}",
            "data.block_size=32",
            "data.num_workers=0",
            f"model.hf.config={yaml.safe_dump(model or GPT2_BYTES, default_flow_style=True).strip()}",
            "loss.count_key=labels",
            f"train.max_steps={steps}",
            "train.batch_size=4",
            *overrides,
        ],
    )
    tk.Trainer(config, progress=False).fit()
    return out / name
