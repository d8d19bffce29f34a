"""Run aladdinpersson/Machine-Learning-Collection ML/Pytorch/Basics/pytorch_lr_ratescheduler.py
with its training loop untouched, at a reduced size, then its test loss.
Changes, all outside the loop: a torchvision stand-in (MNIST from the raw idx files of $MNIST_DIR,
first $N_TRAIN / $N_TEST; ToTensor = uint8/255 as [1,28,28]); the constants named NAME=VALUE on
the command line replace their lines; `verbose=True` is dropped from ReduceLROnPlateau (torch
2.13 no longer takes it: TypeError); the script stops before its closing check_accuracy (which
feeds [B,1,28,28] to Linear(784) and raises). Seeded with torch.manual_seed(SEED) first (the
script seeds nothing). Prints the lr of each epoch and the final mean cross-entropy on the test
images.  usage: run_original.py SEED [NAME=VALUE ...]"""

import os
import re
import struct
import sys
import types

import torch


def idx(path):
    raw = open(path, "rb").read()
    dims = struct.unpack(">" + "I" * raw[3], raw[4 : 4 + 4 * raw[3]])
    return torch.frombuffer(bytearray(raw[4 + 4 * raw[3] :]), dtype=torch.uint8).view(*dims)


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root, train=True, transform=None, download=False):
        p, n = ("train", int(os.environ["N_TRAIN"])) if train else ("t10k", int(os.environ["N_TEST"]))
        self.data = idx(f"{os.environ['MNIST_DIR']}/{p}-images-idx3-ubyte")[:n]
        self.targets = idx(f"{os.environ['MNIST_DIR']}/{p}-labels-idx1-ubyte")[:n].long()
        self.transform = transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.transform(self.data[i]), int(self.targets[i])


class ToTensor:
    def __call__(self, img):
        return img.unsqueeze(0).float().div(255)


tv = types.ModuleType("torchvision")
tv.datasets = types.ModuleType("torchvision.datasets")
tv.datasets.MNIST = MNIST
tv.transforms = types.ModuleType("torchvision.transforms")
tv.transforms.ToTensor = ToTensor
sys.modules.update({"torchvision": tv, "torchvision.datasets": tv.datasets, "torchvision.transforms": tv.transforms})

here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, "pytorch_lr_ratescheduler.py")).read()
src = src.split("# Check accuracy")[0].replace(", verbose=True", "")
src = src.replace(
    '    print(f"Cost at epoch {epoch} is {mean_loss}")',
    '    print(f"Cost at epoch {epoch} is {mean_loss}", "lr", optimizer.param_groups[0]["lr"])',
)
for kv in sys.argv[2:]:
    k, v = kv.split("=")
    src, n = re.subn(rf"^{k} = .*$", f"{k} = {v}", src, flags=re.M)
    assert n == 1, k
torch.manual_seed(int(sys.argv[1]))
g = {"__name__": "__main__"}
exec(compile(src, "pytorch_lr_ratescheduler.py", "exec"), g)
test = MNIST("", train=False, transform=ToTensor())
x = torch.stack([test[i][0] for i in range(len(test))]).reshape(len(test), -1)
model = g["model"].eval()
with torch.no_grad():
    print(f"FULL test loss {torch.nn.functional.cross_entropy(model(x), test.targets).item():.6f}")
