"""Encoded images for the image path's tests: a dataset of PNG/JPEG bytes of several sizes whose
class is the dominant colour, a tiny CNN for it, and the preprocess the run declares."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torch import nn

CLASSES = ["red", "green", "blue"]
PREPROCESS = {"mode": "RGB", "resize": 20, "crop": 16, "mean": [0.5, 0.4, 0.3], "std": [0.25, 0.2, 0.3]}
SIZES = [(24, 32), (40, 30), (20, 20), (33, 21)]  # (width, height): landscape, portrait, square


def encode(pixels: np.ndarray, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def image_pixels(label: int, seed: int, size: tuple[int, int] = (24, 32)) -> np.ndarray:
    """A noisy uint8 RGB image of ``size`` whose channel ``label`` is brightest."""
    rng = np.random.default_rng(seed)
    width, height = size
    pixels = rng.integers(0, 120, (height, width, 3))
    pixels[:, :, label] += rng.integers(80, 135, (height, width))
    return pixels.astype(np.uint8)


class EncodedImages(torch.utils.data.Dataset):
    """(encoded image bytes, label): PNG and JPEG, of the sizes in SIZES."""

    classes = CLASSES

    def __init__(self, n: int, seed: int) -> None:
        self.items = []
        for i in range(n):
            label = i % 3
            pixels = image_pixels(label, seed * 100_000 + i, SIZES[i % len(SIZES)])
            self.items.append((encode(pixels, "PNG" if i % 2 else "JPEG"), label))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def make_data():
    return EncodedImages(96, 0), EncodedImages(24, 1)


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def image_run_overrides() -> list[str]:
    import json

    return [
        "model.target=imagedata:make_cnn",
        "data.target=imagedata:make_data",
        "data.num_workers=0",
        f"data.preprocess={json.dumps(PREPROCESS)}",
    ]
