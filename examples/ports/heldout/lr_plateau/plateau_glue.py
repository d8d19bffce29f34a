"""Glue for aladdinpersson's pytorch_lr_ratescheduler.py (Machine-Learning-Collection) on `keel train`."""
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
    dims = struct.unpack(">" + "I" * raw[3], raw[4:4 + 4 * raw[3]])
    return torch.frombuffer(bytearray(raw[4 + 4 * raw[3]:]), dtype=torch.uint8).view(*dims)


def _split(root: str, prefix: str, n: int):
    x = _idx(f"{root}/{prefix}-images-idx3-ubyte")[:n].reshape(n, -1).float().div(255)  # ToTensor, flattened
    return torch.utils.data.TensorDataset(x, _idx(f"{root}/{prefix}-labels-idx1-ubyte")[:n].long())


def mnist(root: str, num_train: int, num_test: int):
    return _split(root, "train", num_train), _split(root, "t10k", num_test)


_losses = []  # the training batches' losses of the current epoch


class RecordingCE(torch.nn.CrossEntropyLoss):
    """CrossEntropyLoss that keeps each training batch's loss (the script's `losses` list)."""

    def forward(self, output, target):
        loss = super().forward(output, target)
        if torch.is_grad_enabled():  # training, not validation
            _losses.append(loss.item())
        return loss


class TrainLossPlateau:
    """ReduceLROnPlateau stepped with the epoch's mean training loss (`schedule.monitor` takes only
    validation metrics). A resume mid-epoch loses the epoch's losses so far."""

    def __init__(self, optimizer, **args):
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **args)

    def step(self):
        self.plateau.step(sum(_losses) / len(_losses))
        _losses.clear()

    def state_dict(self):
        return self.plateau.state_dict()

    def load_state_dict(self, state):
        self.plateau.load_state_dict(state)
