"""Glue for aladdinpersson's pytorch_lr_ratescheduler.py (Machine-Learning-Collection) on `keel train`:
the script's model, MNIST from the raw idx files."""

import ast
import struct

import torch


def model(script: str) -> torch.nn.Module:
    """The script's `model = nn.Sequential(...)` line (the script trains at import)."""
    tree = ast.parse(open(script).read())
    line = [n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "model"]
    scope = {"nn": torch.nn, "device": "cpu"}
    exec(compile(ast.Module(body=line, type_ignores=[]), script, "exec"), scope)
    return scope["model"]


def _idx(path: str) -> torch.Tensor:
    raw = open(path, "rb").read()
    dims = struct.unpack(">" + "I" * raw[3], raw[4 : 4 + 4 * raw[3]])
    return torch.frombuffer(bytearray(raw[4 + 4 * raw[3] :]), dtype=torch.uint8).view(*dims)


def _split(root: str, prefix: str, n: int) -> torch.utils.data.TensorDataset:
    x = _idx(f"{root}/{prefix}-images-idx3-ubyte")[:n].reshape(n, -1).float().div(255)  # ToTensor, flattened
    return torch.utils.data.TensorDataset(x, _idx(f"{root}/{prefix}-labels-idx1-ubyte")[:n].long())


def mnist(root: str, num_train: int, num_test: int):
    """(train, validation): the first `num_train` training images, the first `num_test` test images."""
    return _split(root, "train", num_train), _split(root, "t10k", num_test)
