"""Glue for pytorch/examples mnist_rnn/main.py on `keel train`: its own Net, MNIST from the raw idx files."""

import importlib.util
import struct
import sys
import types

import torch


def net(script: str) -> torch.nn.Module:
    """The script's Net, loaded from its main.py (torchvision stubbed if it does not import)."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        sys.modules["torchvision"] = types.SimpleNamespace(datasets=None, transforms=None)
    spec = importlib.util.spec_from_file_location("mnist_rnn_main", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Net()


def _idx(path: str) -> torch.Tensor:
    raw = open(path, "rb").read()
    dims = struct.unpack(">" + "I" * raw[3], raw[4 : 4 + 4 * raw[3]])
    return torch.frombuffer(bytearray(raw[4 + 4 * raw[3] :]), dtype=torch.uint8).view(*dims)


def _split(root: str, prefix: str, n: int) -> torch.utils.data.TensorDataset:
    x = _idx(f"{root}/{prefix}-images-idx3-ubyte")[:n].unsqueeze(1).float().div(255)
    y = _idx(f"{root}/{prefix}-labels-idx1-ubyte")[:n].long()
    return torch.utils.data.TensorDataset((x - 0.1307) / 0.3081, y)  # ToTensor, Normalize


def train_test(root: str, num_train: int, num_test: int):
    return _split(root, "train", num_train), _split(root, "t10k", num_test)
