"""nanoGPT's model and its shakespeare_char data for ``keel train`` (the port's only code).

The model is nanoGPT's own ``model.py``, imported from a nanoGPT checkout (``src``); nothing of
it is copied here. The data are the ``train.bin``/``val.bin`` that nanoGPT's
``data/shakespeare_char/prepare.py`` writes: every window of ``block_size`` tokens and the same
window one token on. nanoGPT draws random windows for each batch; here torchkeel shuffles the
windows each epoch (without replacement, from the run's seed). Validation takes the val windows
in one fixed random order, so ``val.max_batches`` (nanoGPT's ``eval_iters``) scores random
windows, the same ones each time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


def gpt(src: str, **config) -> torch.nn.Module:
    """nanoGPT's ``GPT(GPTConfig(**config))`` from ``<src>/model.py``."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", Path(src) / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT(module.GPTConfig(**config))


class Windows(Dataset):
    """``(ids[s : s + block], ids[s + 1 : s + 1 + block])`` for the window starts ``starts``."""

    def __init__(self, ids: torch.Tensor, block_size: int, starts: torch.Tensor) -> None:
        self.ids, self.block_size, self.starts = ids, block_size, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        return self.ids[s : s + self.block_size], self.ids[s + 1 : s + 1 + self.block_size]


def shakespeare_char(data_dir: str, block_size: int, val_order_seed: int = 0) -> tuple[Windows, Windows]:
    """Train and val windows of ``<data_dir>/{train,val}.bin`` (uint16 token ids)."""

    def ids(split: str) -> torch.Tensor:
        return torch.from_numpy(np.fromfile(Path(data_dir) / f"{split}.bin", dtype=np.uint16).astype(np.int64))

    train, val = ids("train"), ids("val")
    # nanoGPT's window starts: 0 .. len - block_size - 1
    val_starts = torch.randperm(len(val) - block_size, generator=torch.Generator().manual_seed(val_order_seed))
    return Windows(train, block_size, torch.arange(len(train) - block_size)), Windows(val, block_size, val_starts)
