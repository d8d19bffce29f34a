"""``train.activation_checkpointing``: the blocks found by structure (or named), fewer activations
kept, and the same losses as without it — dropout included."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchkeel as tk
from torchkeel.errors import ConfigError
from torchkeel.train.recompute import checkpoint_activations, repeated_blocks


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear, self.drop = nn.Linear(dim, dim), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.nn.functional.gelu(self.linear(x)))


class Net(nn.Module):
    """What a user writes: an input layer, a stack of blocks, a head (and no seeding of its own)."""

    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(16, dim), nn.Linear(dim, 4)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,), generator=g))


def losses(tmp_path, name, model, *overrides):
    config = tk.load_config(
        None,
        [f"out_dir={tmp_path}", f"name={name}", "train.batch_size=16", "train.log_every=1", "data.num_workers=0"]
        + list(overrides),
    )
    tk.Trainer(config, model=model, train_data=data(), progress=False).fit()
    return [r["loss"] for r in tk.read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"]


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors the forward keeps for the backward (outside recomputed blocks)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return total


def test_true_recomputes_the_blocks_keeps_less_and_trains_to_the_same_losses(tmp_path):
    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    recomputed = Net()
    assert checkpoint_activations(recomputed, True) == 3  # the three Blocks, not the embedding or head
    x = torch.randn(64, 16)
    assert saved_bytes(recomputed, x) < 0.5 * saved_bytes(plain, x)
    torch.manual_seed(0)
    without = losses(tmp_path, "without", Net())
    torch.manual_seed(0)
    with_it = losses(tmp_path, "with", Net(), "train.activation_checkpointing=true")
    assert len(with_it) == len(without) == 6
    assert max(abs(a - b) for a, b in zip(with_it, without)) <= 1e-6  # dropout's masks replayed


def test_a_list_names_the_classes_and_the_old_key_is_an_alias(tmp_path):
    torch.manual_seed(0)
    named = losses(tmp_path, "named", Net(), "train.activation_checkpointing=[Block]")
    torch.manual_seed(0)
    old = losses(tmp_path, "old", Net(), "dist.activation_checkpointing=[Block]")
    torch.manual_seed(0)
    without = losses(tmp_path, "without", Net())
    assert max(abs(a - b) for a, b in zip(named, without)) <= 1e-6 and named == old
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing: no module of class \['Blok'\]"):
        checkpoint_activations(Net(), ["Blok"])
    with pytest.raises(ConfigError, match="dist.activation_checkpointing \\(its old name\\) are both set"):
        tk.load_config(None, ["train.activation_checkpointing=true", "dist.activation_checkpointing=[Block]"])


def test_a_model_without_repeated_blocks_is_told_to_name_its_classes():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert repeated_blocks(mlp) == []
    with pytest.raises(
        ConfigError, match=r"true found no transformer blocks .*train.activation_checkpointing=\[Block\]"
    ):
        checkpoint_activations(mlp, True)
    assert checkpoint_activations(mlp, False) == 0 and checkpoint_activations(mlp, []) == 0


def test_a_transformers_model_checkpoints_its_own_layers_with_the_same_losses(tmp_path):
    pytest.importorskip("transformers")  # the hf extra, which make setup installs
    from torchkeel.train.hf import build_hf_model

    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 32, "n_positions": 64}
    config = tk.load_config(None, [f"model.hf.config={gpt2}"])  # dropout 0.1, as GPT-2's default
    ids = torch.randint(0, 32, (48, 12), generator=torch.Generator().manual_seed(0))
    samples = [{"input_ids": row, "labels": row.clone()} for row in ids]

    def run(name, *overrides):
        torch.manual_seed(0)
        model = build_hf_model(config.model.hf)
        cfg = tk.load_config(
            None,
            [f"out_dir={tmp_path}", f"name={name}", "train.batch_size=8", "train.log_every=1", "data.num_workers=0"]
            + list(overrides),
        )
        tk.Trainer(cfg, model=model, train_data=samples, progress=False).fit()
        return model, [r["loss"] for r in tk.read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"]

    model, with_it = run("with", "train.activation_checkpointing=true")
    _, without = run("without")
    on = getattr(model, "is_activation_checkpointing", None)  # transformers 5; before, is_gradient_checkpointing
    assert (on if on is not None else model.is_gradient_checkpointing) and len(with_it) == 6
    assert max(abs(a - b) for a, b in zip(with_it, without)) <= 1e-6
