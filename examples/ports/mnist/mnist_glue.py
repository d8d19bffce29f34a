"""pytorch/examples ``mnist/main.py``'s model and data for ``keel train`` (the port's only code).

``net`` takes the class ``Net`` from the script's own source (its torch imports and the class,
not the rest: the script imports torchvision at the top, and the torchvision wheel for torch 2.13
on PyPI is a CUDA build that does not load beside the CPU torch). ``train_test`` reads MNIST's
raw idx files and applies the script's transform, ``ToTensor`` (``/ 255``) then
``Normalize((0.1307,), (0.3081,))``, to all images at once.
"""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import torch
from torch.utils.data import TensorDataset


def net(script: str) -> torch.nn.Module:
    """``Net()`` as defined in ``script`` (mnist/main.py)."""
    tree = ast.parse(Path(script).read_text())
    keep = [node for node in tree.body if is_net(node) or is_torch_import(node)]
    namespace: dict = {}
    exec(compile(ast.Module(keep, type_ignores=[]), script, "exec"), namespace)
    return namespace["Net"]()


def is_net(node: ast.stmt) -> bool:
    return isinstance(node, ast.ClassDef) and node.name == "Net"


def is_torch_import(node: ast.stmt) -> bool:
    return isinstance(node, (ast.Import, ast.ImportFrom)) and "torchvision" not in ast.unparse(node)


def read_idx(path: Path) -> torch.Tensor:
    """An idx file (MNIST's raw format) as a uint8 tensor of its dimensions."""
    raw = path.read_bytes()
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim :]), dtype=torch.uint8).view(*dims)


def train_test(
    root: str, num_train: int | None = None, num_test: int | None = None
) -> tuple[TensorDataset, TensorDataset]:
    """The first ``num_train`` training and ``num_test`` test images of ``root`` (all: ``None``)."""

    def split(prefix: str, n: int | None) -> TensorDataset:
        images = read_idx(Path(root) / f"{prefix}-images-idx3-ubyte")[:n]
        labels = read_idx(Path(root) / f"{prefix}-labels-idx1-ubyte")[:n].long()
        x = images.unsqueeze(1).to(torch.float32).div(255)
        return TensorDataset(x.sub(0.1307).div(0.3081), labels)

    return split("train", num_train), split("t10k", num_test)
