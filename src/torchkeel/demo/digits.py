"""Handwritten digits (``sklearn.datasets.load_digits``: 1,797 real 8×8 images) and a small CNN.

The split is fixed (stratified, ``random_state``), so every run validates on the same 360 images.
The samples are 8×8 grayscale images (uint8); ``data.preprocess`` turns them into tensors, and
the export records it, so that the server takes a PNG of a digit through the same code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from torchkeel.config.load import load_config
from torchkeel.errors import MissingExtraError
from torchkeel.export.export import export_run
from torchkeel.serve.app import serve_in_background
from torchkeel.train.trainer import Trainer

DEMO_CONFIG: dict[str, Any] = {
    "name": "demo",
    "seed": 0,
    "model": {"target": "torchkeel.demo.digits:DigitsCNN"},
    "data": {
        "target": "torchkeel.demo.digits:load_digit_images",
        "num_workers": 0,  # in memory: workers add only start-up
        "preprocess": {"mode": "L", "resize": [8, 8]},
    },  # pixel / 255, as [1, 8, 8]
    "optim": {"name": "adamw", "lr": 3e-3, "weight_decay": 1e-4},
    "schedule": {"warmup_steps": 20, "decay": "cosine"},
    "train": {"max_epochs": 12, "batch_size": 32, "clip_grad_norm": 1.0, "log_every": 25},
}


def load_digits_split(val_fraction: float = 0.2, split_seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation sets of 1×8×8 float images in [0, 1] with int64 labels."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise MissingExtraError("demo", "scikit-learn", "the digits demo") from None
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    x_train, x_val, y_train, y_val = train_test_split(
        images, labels, test_size=val_fraction, random_state=split_seed, stratify=labels
    )
    train = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    val = TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val))
    train.classes = val.classes = [str(d) for d in range(10)]  # class labels, for export and serving
    return train, val


class _Images(torch.utils.data.Dataset):
    """(uint8 [8, 8] image, label) pairs."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels
        self.classes = [str(d) for d in range(10)]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[index], int(self.labels[index])


def load_digit_images(val_fraction: float = 0.2, split_seed: int = 0) -> tuple[_Images, _Images]:
    """Train and validation sets of 8×8 grayscale uint8 images (0–255) with their labels.

    The same split as ``load_digits_split``; the images are what a PNG of the digit holds.
    """
    train, val = load_digits_split(val_fraction, split_seed)

    def images(dataset: TensorDataset) -> _Images:
        x, y = dataset.tensors
        return _Images(np.round(x[:, 0].numpy() * 255).astype(np.uint8), y.numpy())

    return images(train), images(val)


class DigitsCNN(nn.Module):
    """Two 3×3 convolutions, a pooling layer and a two-layer head: about 0.1M parameters."""

    def __init__(self, channels: int = 32, hidden: int = 128, num_classes: int = 10, dropout: float = 0.2) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 16, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def run_demo(out_dir: str | Path = "runs", overrides: list[str] | None = None, progress: bool = True) -> dict[str, Any]:
    """Train the demo into ``<out_dir>/demo`` (replacing an earlier demo run) and return the summary."""
    config = load_config(None, overrides or [], base={**DEMO_CONFIG, "out_dir": str(out_dir)})
    return Trainer(config, overwrite=True, progress=progress).fit()


def export_and_serve_one(run_dir: str | Path) -> dict[str, Any]:
    """Export the demo run (TorchScript, parity checked), serve it, and send it a PNG of a digit.

    Writes the first validation image as ``<run_dir>/digit.png`` and returns the export's parity
    report, the export directory, the PNG's path and the served label of it with its true label.
    """
    import base64
    import http.client
    import json
    from urllib.parse import urlparse

    from PIL import Image

    export_dir = Path(run_dir) / "export-torchscript"
    meta = export_run(run_dir, "torchscript", export_dir)
    image, label = load_digit_images()[1][0]
    png = Path(run_dir) / "digit.png"
    Image.fromarray(image).save(png)  # uint8 [8, 8]: grayscale
    b64 = base64.b64encode(png.read_bytes()).decode()
    body = json.dumps({"instances": [{"image_bytes": {"b64": b64}}], "parameters": {"top_k": 1}})
    with serve_in_background(export_dir) as url:
        address = urlparse(url)
        conn = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        conn.request("POST", f"/v1/models/{meta['name']}:predict", body)
        answer = json.loads(conn.getresponse().read())
        conn.close()
    best = answer["predictions"][0][0]
    return {
        "parity": meta["parity"],
        "export_dir": str(export_dir),
        "url": url,
        "png": str(png),
        "predicted": best["label"],
        "score": best["score"],
        "label": str(int(label)),
    }
