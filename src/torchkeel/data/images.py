"""Image preprocessing shared by training and serving: one spec, one implementation, no skew.

The spec is ``data.preprocess`` in the config and ``preprocess`` in ``model.json``::

    {"mode": "RGB", "resize": 256, "crop": 224, "interpolation": "bilinear",
     "scale": 0.00392156862745098, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}

The steps, in order, follow torchvision's PIL transforms so that a model trained with
``Resize(256), CenterCrop(224), ToTensor(), Normalize(mean, std)`` declares exactly that:

1. decode (JPEG, PNG, WebP, BMP, GIF's first frame, TIFF) and convert to ``mode`` (``RGB`` or ``L``);
2. ``resize``: an int scales the shorter side to it (the longer one to ``int(size * long / short)``),
   ``[h, w]`` resizes to that size (Pillow's resize, antialiased, as torchvision does on images);
3. ``crop``: a centre crop of ``c`` or ``[h, w]`` (top = ``round((H - h) / 2)``, as torchvision);
4. ``pixel / (1 / scale)``, then ``(x - mean) / std`` per channel, in float32, as ``[C, H, W]``
   (with the default scale, bit for bit what ``ToTensor`` and ``Normalize`` compute).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchkeel.config.preprocess import MODES, parse_preprocess
from torchkeel.errors import MissingExtraError, first_line

FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
MAX_PIXELS = 40_000_000  # 40 megapixels: an 8K photo fits, a decompression bomb does not


class ImageError(ValueError):
    """An image that cannot be used: undecodable, of a format not accepted, or too large."""


@dataclass(frozen=True)
class ImagePreprocess:
    """Encoded image (or a PIL image, or a uint8 ``[H, W(, C)]`` array) → float32 ``[C, H, W]``."""

    mode: str = "RGB"
    resize: tuple[int, ...] | None = None
    crop: tuple[int, int] | None = None
    interpolation: str = "bilinear"
    scale: float = 1 / 255
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], where: str = "preprocess") -> ImagePreprocess:
        """Build from a spec (config section or ``model.json``); a wrong value is a ConfigError naming its key."""
        return cls(**parse_preprocess(spec, where))

    def to_spec(self) -> dict[str, Any]:
        """The spec as ``model.json`` records it."""

        def size(value: tuple[int, ...] | None) -> Any:
            return None if value is None else (value[0] if len(value) == 1 else list(value))

        return {
            "mode": self.mode,
            "resize": size(self.resize),
            "crop": size(self.crop),
            "interpolation": self.interpolation,
            "scale": self.scale,
            "mean": list(self.mean),
            "std": list(self.std),
        }

    @property
    def channels(self) -> int:
        return MODES[self.mode]

    @property
    def output_shape(self) -> list[int] | None:
        """``[C, H, W]`` when the spec fixes the size (a crop, or a resize to ``[h, w]``), else None."""
        size = self.crop or (self.resize if self.resize and len(self.resize) == 2 else None)
        return [self.channels, *size] if size else None

    def __call__(self, image: Any) -> torch.Tensor:
        """For datasets: ``image`` (bytes, a path, a PIL image or a uint8 array) as a float32 tensor."""
        if isinstance(image, (str, Path)):
            image = Path(image).read_bytes()
        return torch.from_numpy(self.array(image))

    def array(self, image: Any, max_pixels: int = MAX_PIXELS) -> np.ndarray:
        """``image`` (bytes, a PIL image or a uint8 array) as a float32 ``[C, H, W]`` array.

        Raises:
            ImageError: undecodable, of a format not accepted, over ``max_pixels``, or smaller than the crop.
        """
        pil = _pil()
        if isinstance(image, (bytes, bytearray, memoryview)):
            image = decode(bytes(image), max_pixels)
        elif isinstance(image, np.ndarray):
            if image.dtype != np.uint8 or image.ndim not in (2, 3):
                raise ImageError(
                    f"an image array must be uint8 [H, W] or [H, W, C], got {image.dtype} {list(image.shape)}"
                )
            image = pil.Image.fromarray(image)
        elif not isinstance(image, pil.Image.Image):
            raise ImageError(f"expected encoded image bytes, a PIL image or a uint8 array, got {type(image).__name__}")
        if image.mode != self.mode:
            image = image.convert(self.mode)
        if self.resize is not None:
            size = self._resized(image.size)
            if size != image.size:
                image = image.resize(size, _RESAMPLE[self.interpolation](pil))
        if self.crop is not None:
            image = self._cropped(image)
        pixels = np.asarray(image)
        return self._normalized(pixels if pixels.ndim == 3 else pixels[:, :, None])

    def _resized(self, size: tuple[int, int]) -> tuple[int, int]:
        """Pillow's (width, height) after ``resize``, with torchvision's arithmetic."""
        assert self.resize is not None
        if len(self.resize) == 2:
            return self.resize[1], self.resize[0]
        w, h = size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.resize[0], int(self.resize[0] * long / short)
        return (new_short, new_long) if w <= h else (new_long, new_short)

    def _cropped(self, image: Any) -> Any:
        assert self.crop is not None
        h, w = self.crop
        width, height = image.size
        if h > height or w > width:
            raise ImageError(f"the image is {width}×{height} after resizing, smaller than the {w}×{h} crop")
        top, left = int(round((height - h) / 2.0)), int(round((width - w) / 2.0))
        return image.crop((left, top, left + w, top + h))

    def _normalized(self, pixels: np.ndarray) -> np.ndarray:
        """``[H, W, C]`` uint8 → ``[C, H, W]`` float32, with torchvision's float32 operations in its order."""
        out = np.empty((self.channels, *pixels.shape[:2]), dtype=np.float32)
        for c in range(self.channels):
            out[c] = pixels[:, :, c]
        np.divide(out, np.float32(1 / self.scale), out=out)
        if self.mean:
            np.subtract(out, np.asarray(self.mean, np.float32).reshape(-1, 1, 1), out=out)
        if self.std:
            np.divide(out, np.asarray(self.std, np.float32).reshape(-1, 1, 1), out=out)
        return out


def decode(data: bytes, max_pixels: int = MAX_PIXELS) -> Any:
    """Encoded bytes → a loaded PIL image (GIF: its first frame).

    The size is read from the header and checked against ``max_pixels`` before any pixel is
    decoded, so a small file that would expand to gigabytes is refused cheaply.

    Raises:
        ImageError: not an image, a format outside ``FORMATS``, over ``max_pixels``, or truncated.
    """
    pil = _pil()
    try:
        image = pil.Image.open(io.BytesIO(data), formats=FORMATS)
    except pil.Image.DecompressionBombError as exc:
        raise ImageError(f"the image is over the limit of {max_pixels:,} pixels ({first_line(exc)})") from None
    except (pil.UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        other = _format_of(data)
        if other is not None:
            raise ImageError(f"{other} images are not accepted; send one of {', '.join(FORMATS)}") from None
        raise ImageError(
            f"not a decodable image ({len(data)} bytes of no format {', '.join(FORMATS)} can read)"
        ) from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"the image is {width}×{height} = {width * height:,} pixels, over the limit of {max_pixels:,}")
    try:
        image.load()
    except Exception as exc:  # noqa: BLE001 - Pillow's decoders raise OSError, ValueError, SyntaxError, struct.error...
        raise ImageError(
            f"the {image.format} image cannot be decoded ({type(exc).__name__}: {first_line(exc)})"
        ) from None
    return image


def _format_of(data: bytes) -> str | None:
    """The format Pillow recognises in ``data`` among all it knows (header only, nothing decoded)."""
    pil = _pil()
    try:
        with pil.Image.open(io.BytesIO(data)) as image:
            return image.format
    except Exception:  # noqa: BLE001 - anything unreadable is simply "no format"
        return None


_RESAMPLE = {
    "nearest": lambda pil: pil.Image.Resampling.NEAREST,
    "bilinear": lambda pil: pil.Image.Resampling.BILINEAR,
    "bicubic": lambda pil: pil.Image.Resampling.BICUBIC,
}


def _pil() -> Any:
    try:
        import PIL
        import PIL.Image

        return PIL
    except ImportError:
        raise MissingExtraError("serve", "pillow", "image preprocessing") from None


__all__ = ["FORMATS", "MAX_PIXELS", "ImageError", "ImagePreprocess", "decode"]
