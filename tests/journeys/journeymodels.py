"""The models of the journeys, written as users write them: factories that do not seed
themselves, and a transformers-shaped model whose ``forward`` names exactly what it takes.

Both record the ids of the samples they train on (``$JOURNEY_IDS``, one per line, appended by
every rank; only in training mode, so validation and export do not count), and sleep
``$JOURNEY_DELAY`` seconds per training forward so that a kill can land mid-epoch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch import nn

NUM_FEATURES = 8
NUM_CLASSES = 4
VOCAB = 64
ID_BASE = 60  # a sample's id is written into its first two tokens: 1 + id // 60, 1 + id % 60


def record(ids: torch.Tensor) -> None:
    path = os.environ.get("JOURNEY_IDS")
    if path and ids.numel():
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, "".join(f"{int(i)}\n" for i in ids.tolist()).encode())
        os.close(fd)
    delay = float(os.environ.get("JOURNEY_DELAY", "0"))
    if delay:
        time.sleep(delay)


class Logged(nn.Module):
    """A plain classifier; column 0 of the input is the sample's id, which it records and ignores."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            record(x[:, 0])
        return self.net(x[:, 1:])


def mlp() -> nn.Module:
    return Logged(nn.Sequential(nn.Linear(NUM_FEATURES, 32), nn.ReLU(), nn.Linear(32, NUM_CLASSES)))


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyLM(nn.Module):
    """``forward(input_ids, attention_mask, labels=None)``: any other key is a TypeError."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=0)
        self.mix = nn.Sequential(nn.Linear(2 * dim, 48), nn.Tanh(), nn.Linear(48, VOCAB))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None
    ) -> Output:
        if self.training:
            record((input_ids[:, 0] - 1) * ID_BASE + input_ids[:, 1] - 1)
        current = self.embed(input_ids) * attention_mask[..., None]
        previous = nn.functional.pad(current[:, :-1], (0, 0, 1, 0))
        logits = self.mix(torch.cat([current, previous], dim=-1))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return Output(loss, logits)


def tiny_lm() -> nn.Module:
    return TinyLM()
