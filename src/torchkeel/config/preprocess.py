"""The ``data.preprocess`` spec (config section or ``model.json``), read and checked without
decoding anything: the config layer validates it, ``torchkeel.data.images`` applies it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchkeel.errors import ConfigError

INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
MODES = {"RGB": 3, "L": 1}


def parse_preprocess(spec: Mapping[str, Any], where: str = "preprocess") -> dict[str, Any]:
    """The spec's values, defaults filled in (``ImagePreprocess``'s fields); a wrong value is a
    ``ConfigError`` naming its key."""
    known = {"mode", "resize", "crop", "interpolation", "scale", "mean", "std"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {unknown}; the keys are {sorted(known)}")
    mode = spec.get("mode") or "RGB"
    if mode not in MODES:
        raise ConfigError(f"{where}.mode must be RGB or L, got {mode!r}")
    channels = MODES[mode]
    interpolation = spec.get("interpolation") or "bilinear"
    if interpolation not in INTERPOLATIONS:
        raise ConfigError(f"{where}.interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
    scale = spec.get("scale", 1 / 255)
    if scale is None:
        scale = 1 / 255
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ConfigError(f"{where}.scale must be a positive number (1/255 maps pixels to [0, 1]), got {scale!r}")
    mean, std = _floats(spec.get("mean"), f"{where}.mean"), _floats(spec.get("std"), f"{where}.std")
    for key, values in (("mean", mean), ("std", std)):
        if values and len(values) not in (1, channels):
            raise ConfigError(f"{where}.{key} has {len(values)} values; mode {mode} has {channels} channel(s)")
    if any(s <= 0 for s in std):
        raise ConfigError(f"{where}.std must be positive, got {list(std)}")
    crop = _size(spec.get("crop"), f"{where}.crop")
    return {
        "mode": mode,
        "resize": _size(spec.get("resize"), f"{where}.resize"),
        "crop": (crop * 2 if len(crop) == 1 else crop) if crop else None,
        "interpolation": interpolation,
        "scale": float(scale),
        "mean": mean,
        "std": std,
    }


def _floats(value: Any, key: str) -> tuple[float, ...]:
    if value is None:
        return ()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),)
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        raise ConfigError(f"{key} must be a number or a list of numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _size(value: Any, key: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        not isinstance(items, (list, tuple))
        or len(items) not in (1, 2)
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in items)
    ):
        raise ConfigError(f"{key} must be a positive integer or [height, width], got {value!r}")
    return tuple(items)
