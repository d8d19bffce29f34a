"""The padded-sequence example's model and step function: a prediction per token, the loss summed
over real tokens and returned with their count, so accumulation weighs by tokens."""

from __future__ import annotations

import torch
from make_data import NUM_CLASSES
from torch import nn

import torchkeel as tk


class TokenClassifier(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))  # a prediction per token


def step(model: nn.Module, batch) -> tk.StepOutput:
    """Cross-entropy of every real token against its row's label, as a sum with the count of
    tokens: accumulation then weighs micro-batches by their tokens, not their rows."""
    tokens, labels = batch
    logits = model(tokens)
    mask = (tokens != 0).float()
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, None].expand_as(tokens), reduction="none")
    correct = (logits.argmax(dim=-1) == labels[:, None]).float() * mask
    # With a count, the loss and the metrics are sums: torchkeel divides them by the count.
    return tk.StepOutput((per_token * mask).sum(), count=mask.sum(), metrics={"token_accuracy": correct.sum()})
