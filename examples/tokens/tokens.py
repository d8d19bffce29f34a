"""A transformers-shaped language model and token data, trained as ``model(**batch).loss``.

    python examples/tokens/tokens.py data/          # writes data/tokens/{train,val}.parquet
    PYTHONPATH=examples/tokens keel train examples/tokens/tokens.yaml
    keel export runs/tokens-example --format onnx && keel serve runs/tokens-example/export-onnx

The model's ``forward(input_ids, attention_mask, labels=None)`` is strict, as a transformers
model's is: the padded batches (``collate: pad``) carry exactly those keys. It returns an
object with ``loss`` and ``logits``; the loss is a mean over the non-padding next-token labels,
so accumulation weighs each micro-batch by its labels (``loss.count_key: labels``,
``loss.shift_labels: true``) and ``batch 16 × accumulate 2`` is the same update as ``32 × 1``.
``tiny_gpt2`` builds a real transformers GPT-2 from a config (nothing is downloaded) for the
same data, when ``pip install 'torchkeel[hf]'`` is there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

VOCAB = 32
PAD = 0


@dataclass
class LMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyLM(nn.Module):
    """Each next token from the current and the previous one: embeddings → MLP → vocabulary."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.mix = nn.Sequential(nn.Linear(2 * dim, 64), nn.ReLU(), nn.Linear(64, vocab))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None
    ) -> LMOutput:
        current = self.embed(input_ids) * attention_mask[..., None]
        previous = nn.functional.pad(current[:, :-1], (0, 0, 1, 0))  # position t sees t - 1 too
        logits = self.mix(torch.cat([current, previous], dim=-1))
        loss = None
        if labels is not None:  # the next token: logits of position t against the label of t + 1
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return LMOutput(loss, logits)


def tiny_gpt2(n_layer: int = 1, n_embd: int = 32) -> nn.Module:
    """A transformers GPT-2 built from a config (no download, no dropout) for the same vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=2,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=PAD,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def sequences(num: int, seed: int) -> list[np.ndarray]:
    """Token sequences of 4 to 24 tokens that count up by a step of their own, modulo the
    vocabulary (token 0 is padding): each next token follows from the two before it."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        n, start, step = int(rng.integers(4, 25)), int(rng.integers(1, VOCAB)), int(rng.integers(1, 4))
        out.append(1 + (start + step * np.arange(n)) % (VOCAB - 1))
    return out


class TokenDataset(torch.utils.data.Dataset):
    """Dict samples as a tokenized transformers dataset gives them: ``input_ids`` and ``labels``."""

    def __init__(self, num: int, seed: int) -> None:
        self.items = sequences(num, seed)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.items[index].astype(np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


def make_data(num_train: int = 1024, num_val: int = 128) -> tuple[TokenDataset, TokenDataset]:
    return TokenDataset(num_train, seed=1), TokenDataset(num_val, seed=2)


def write_parquet(root: str | Path, num_train: int = 1024, num_val: int = 128) -> Path:
    """The same data as Parquet files: list columns ``input_ids`` and ``labels``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(root) / "tokens"
    out.mkdir(parents=True, exist_ok=True)
    for split, num, seed in (("train", num_train, 1), ("val", num_val, 2)):
        rows = [s.astype(np.int64).tolist() for s in sequences(num, seed)]
        table = pa.table(
            {
                "input_ids": pa.array(rows, type=pa.list_(pa.int64())),
                "labels": pa.array(rows, type=pa.list_(pa.int64())),
            }
        )
        pq.write_table(table, out / f"{split}.parquet", row_group_size=128)
    return out


if __name__ == "__main__":
    print(f"wrote {write_parquet(sys.argv[1] if len(sys.argv) > 1 else 'data')}")
