"""WebDataset tar shards through the ``webdataset`` library: shards are the units of work.

Shards are counted once (tar headers only) so the epoch has a known length. A shard is read as
a stream of raw samples (``webdataset.tariterators``), passed through the seeded shuffle buffer,
and only then decoded, so skipping to a resume position costs no decoding. Decoding uses safe
handlers only — no pickle, no ``torch.load``.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torchkeel.data.order import Unit, buffered_shuffle
from torchkeel.data.sources import Bad, Sample, expand_paths, files_fingerprint
from torchkeel.errors import ConfigError, MissingExtraError, first_line

META_KEYS = ("__key__", "__url__", "__local_path__")


class WebDatasetSource:
    """Samples from WebDataset tar shards (``train-{000000..000099}.tar``, globs, lists).

    Args:
        paths: shard files or patterns.
        input: the sample's key (extension) that is the input, e.g. ``npy``; ``None`` yields the
            decoded sample as a dict (``input_ids.npy`` under the key ``input_ids``).
        target: the key of the label, e.g. ``cls``.
        shuffle_buffer: samples held by the shuffle buffer within a shard (0: shard order).
        image: a ``webdataset`` image spec (``rgb8``, ``torchrgb``, ...) to decode images (needs Pillow).
    """

    def __init__(
        self,
        paths: str | Sequence[str],
        *,
        input: str | None = None,
        target: str | None = None,
        shuffle_buffer: int = 1000,
        image: str | None = None,
        key: str = "data.train",
    ) -> None:
        try:
            import webdataset  # noqa: F401
        except ImportError:
            raise MissingExtraError("data", "webdataset", "format: webdataset") from None
        self.paths = expand_paths(paths, key, ".tar")
        self.input, self.target, self.image = input, target, image
        self.shuffle_buffer = shuffle_buffer
        self._units = [Unit(path, _count_samples(path)) for path in self.paths]
        self._decoder: Any = None

    def units(self) -> list[Unit]:
        return self._units

    def fingerprint(self) -> str:
        return json.dumps(["webdataset", files_fingerprint(self.paths), self.input, self.target])

    def where(self, unit: int, row: int) -> str:
        return f"{self.paths[unit]} sample {row}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_decoder": None}

    def read(
        self, unit: int, first: int, rng: np.random.Generator | None, *, as_samples: bool = True
    ) -> Iterator[Sample | Bad]:
        path = self.paths[unit]
        position = 0
        raw = _raw_samples(path)
        shuffled = buffered_shuffle(raw, self.shuffle_buffer, rng) if self.shuffle_buffer and rng is not None else raw
        try:
            for sample in shuffled:
                position += 1
                if position <= first:
                    continue
                where = f"{path} key {sample.get('__key__')}"
                try:
                    yield Sample(self._convert(self._decode(sample), where), position, where)
                except Exception as exc:  # a corrupt member: this sample is bad, the shard goes on
                    member = getattr(exc, "k", None)  # webdataset's DecodingError names the member, the cause says why
                    cause = exc.__cause__ if exc.__cause__ is not None else exc
                    what = f"{member}: " if member else ""
                    yield Bad(where, f"{what}{type(cause).__name__}: {first_line(cause)}", position)
        except (tarfile.TarError, OSError, ValueError) as exc:
            # The shard itself is damaged: the samples after this point cannot be read.
            yield Bad(
                f"{path} after sample {position}",
                f"{type(exc).__name__}: {first_line(exc)}",
                self._units[unit].num_samples,
            )

    def _decode(self, sample: dict[str, Any]) -> dict[str, Any]:
        if self._decoder is None:
            self._decoder = _decoder(self.image)
        return self._decoder(sample)

    def _convert(self, sample: dict[str, Any], where: str) -> Any:
        if self.input is None:
            return {_key_name(k, sample): _tensor(v) for k, v in sample.items() if k not in META_KEYS}
        for name in (self.input, self.target):
            if name is not None and name not in sample:
                present = ", ".join(k for k in sample if k not in META_KEYS)
                raise KeyError(f"no '{name}' in the sample (it has: {present})")
        x = _tensor(sample[self.input])
        return x if self.target is None else (x, _tensor(sample[self.target]))


def _key_name(key: str, sample: dict[str, Any]) -> str:
    """A member's key without its decoder extension (``input_ids.npy`` → ``input_ids``, the name
    ``model(**batch)`` wants), unless another member has that name too."""
    name = key.rsplit(".", 1)[0]
    clash = name != key and sum(1 for k in sample if k.rsplit(".", 1)[0] == name) > 1
    return key if clash or name == key else name


def _raw_samples(path: str) -> Iterator[dict[str, Any]]:
    from webdataset.tariterators import group_by_keys, tar_file_iterator

    with open(path, "rb") as stream:
        members = ({**member, "__url__": path} for member in tar_file_iterator(stream))
        yield from group_by_keys(members)


def _count_samples(path: str) -> int:
    """Samples in a shard, from its headers only, grouped as ``webdataset`` groups them."""
    from webdataset.tariterators import base_plus_ext

    count, previous = 0, None
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                prefix, _ = base_plus_ext(member.name)
                if prefix is not None and prefix != previous:
                    count, previous = count + 1, prefix
    except (tarfile.TarError, OSError) as exc:
        if count == 0:
            raise ConfigError(f"shard '{path}' is not a readable tar file ({first_line(exc)})") from None
    return count


def _npy(data: bytes) -> np.ndarray:
    """A ``.npy`` member; one without NumPy's header is said to be so (``np.load`` would suggest
    ``allow_pickle``, which would run whatever the bytes hold)."""
    if not data.startswith(b"\x93NUMPY"):
        raise ValueError(f"not a .npy array: no NumPy header (starts with {data[:8]!r}); rewrite it with np.save")
    for _ in range(2):
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except SystemError as exc:
            # NumPy reads the header with ast.literal_eval, and CPython 3.11 can raise a spurious
            # "AST constructor recursion depth mismatch" when another thread builds an AST at that
            # moment (CPython issue 106905): the bytes are fine, so they are read again.
            if "recursion depth mismatch" not in str(exc):
                raise
    return np.load(io.BytesIO(data), allow_pickle=False)


def _decoder(image: str | None) -> Any:
    from webdataset.autodecode import Decoder, handle_extension, imagehandler

    handlers = [
        handle_extension("npy", _npy),
        handle_extension("cls cls2 class count index inx id", lambda data: int(data.decode().strip())),
        handle_extension("json jsn", lambda data: json.loads(data)),
        handle_extension("txt text", lambda data: data.decode("utf-8")),
    ]
    if image is not None:
        handlers.append(imagehandler(image))
    return Decoder(handlers, post=[])


def _tensor(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.astype(np.float32) if value.dtype == np.float64 else value)
    if isinstance(value, bool | int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float32)
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return torch.tensor(value)
    return value
