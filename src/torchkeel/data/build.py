"""The data side of a run, from the config: sources or datasets, collate, transforms, loaders,
and the worker count (``auto``: timed once, cached). The Trainer asks for ``build_loaders``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from torchkeel.config.imports import build_target, resolve_target
from torchkeel.config.schema import DataConfig
from torchkeel.data.bad import BadSampleLedger
from torchkeel.data.collate import build_collate
from torchkeel.data.images import ImagePreprocess
from torchkeel.data.loader import EpochLoader
from torchkeel.data.options import LoaderOptions
from torchkeel.data.sources.hfdatasets import HFDiskDataset
from torchkeel.data.sources.parquet import ParquetSource
from torchkeel.data.sources.text import TextSource
from torchkeel.data.sources.webdataset import WebDatasetSource
from torchkeel.data.stream import StreamLoader
from torchkeel.data.tune import TuneResult, tune_workers
from torchkeel.distributed.agree import agree_min
from torchkeel.distributed.rank import per_rank
from torchkeel.errors import ConfigError
from torchkeel.rng import preserved_rng


class Loader(Protocol):
    """What the Trainer uses of a loader, map-style (``EpochLoader``) or streaming (``StreamLoader``).

    ``num_batches(epoch)`` is what every rank iterates in that epoch; ``streaming`` says whether
    ranks may hold different numbers of batches (then ``TrainingJob.batches`` keeps them in
    step). ``options`` holds the settings both share (``options.batch_size`` is always the job's
    batch, each rank collating ``options.rank_batch_size`` of it); ``num_workers`` is the worker
    processes the loader runs; ``bad`` is its ledger of bad samples and batches handed out.
    ``origin(number, index)`` names where sample ``index`` of the epoch's batch ``number``
    came from; ``state_dict(read_ahead)`` leaves out the latest ``read_ahead`` batches.
    """

    streaming: bool
    options: LoaderOptions
    num_workers: int
    bad: BadSampleLedger

    def num_batches(self, epoch: int) -> int: ...
    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]: ...
    def origin(self, number: int, index: int) -> str | None: ...
    def state_dict(self, read_ahead: int = 0) -> dict[str, Any]: ...
    def load_state_dict(self, state: Any) -> None: ...
    def close(self) -> None: ...


@dataclass
class Loaders:
    train: Loader
    val: Loader | None
    tuning: TuneResult | None
    """How ``num_workers: auto`` chose (``None`` when the count was given)."""
    empty_files: list[str] = field(default_factory=list)
    """Data files with nothing in them (a source's ``empty_files``): no sample, an incident each."""
    sources: dict[str, Any] = field(default_factory=dict)
    """The streaming sources by config key (``data.train``, ``data.val``): their files are
    fingerprinted for resumes (``torchkeel.data.inputs``)."""
    val_sample: dict[str, torch.Tensor] | None = None
    """The first validation sample's tensors (map-style data), for ``checked``."""

    def checked(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` of training, the first one compared with the first validation sample
        (``check_alike``), once per run: a mismatch stops the run at its first step."""
        for batch in batches:
            if self.val_sample is not None:
                sample, self.val_sample = self.val_sample, None
                check_alike(batch, sample)
            yield batch


def is_source(data: Any) -> bool:
    """A streaming source (``ParquetSource``, ``WebDatasetSource`` or one like them)."""
    return callable(getattr(data, "units", None)) and callable(getattr(data, "read", None))


def build_datasets(cfg: DataConfig) -> tuple[Any, Any]:
    """Call ``data.target(**data.args)``; it must return ``(train_dataset, val_dataset)``.

    ``val_dataset`` may be ``None`` (no validation). Each must be map-style (``__len__`` and
    ``__getitem__``) or a streaming source, so that data order can be reproduced and resumed.
    """
    if cfg.target is None:
        raise ConfigError("data.target is not set; give a 'module:callable' that returns (train, val) datasets")
    result = build_target(cfg.target, cfg.args, "data")
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise ConfigError(
            f"data.target={cfg.target!r} returned {type(result).__name__}; "
            "it must return a pair (train_dataset, val_dataset)"
        )
    for which, dataset in zip(("train", "val"), result):
        if dataset is None and which == "val":
            continue
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) and not is_source(dataset):
            raise ConfigError(
                f"data.target={cfg.target!r} returned a {which} dataset of type "
                f"{type(dataset).__name__} without __len__/__getitem__; return map-style datasets"
            )
    return result[0], result[1]


_SOURCES = {
    "parquet": (ParquetSource, ("input", "target", "columns", "bucket_by", "bucket_window")),
    "text": (TextSource, ("tokenizer", "block_size", "pack", "text_key", "chunk_bytes", "mlm_probability")),
    "webdataset": (WebDatasetSource, ("input", "target", "shuffle_buffer", "image")),
}
"""Each streaming format's source, and the ``data.*`` keys it takes under the same names."""
STREAMING_FORMATS = tuple(_SOURCES)


def build_sources(cfg: DataConfig) -> tuple[Any, Any]:
    """The train and val sources of a streaming format."""
    if cfg.train is None:
        raise ConfigError(f"data.format={cfg.format} needs data.train: the files to train on")

    def make(paths: Any, key: str) -> Any:
        kind, names = _SOURCES[cfg.format]
        given = {name: getattr(cfg, name) for name in names}
        if cfg.format == "parquet":
            given["fixed_length"] = cfg.collate == "default"
        elif cfg.format == "webdataset":
            given["input"] = cfg.input if isinstance(cfg.input, str) or cfg.input is None else _one(cfg.input)
        return kind(paths, key=key, **given)

    def made(paths: Any, key: str) -> Any:
        source = make(paths, key)
        if not any(unit.num_samples for unit in source.units()):
            raise ConfigError(f"{key} has no samples in its {len(source.units())} files or parts: point {key} at data")
        return source

    return made(cfg.train, "data.train"), (made(cfg.val, "data.val") if cfg.val is not None else None)


LoaderFactory = Callable[..., Loader]


def loader_factory(
    cfg: DataConfig, *, batch_size: int, seed: int, device: torch.device, rank: int = 0, world_size: int = 1
) -> LoaderFactory:
    """``make(data, num_workers, train=True, batch_size=None)``: a loader for a dataset or source with
    the config's settings (``batch_size``: another than the factory's, the validation's)."""
    collate = (
        build_collate(cfg.collate, cfg.pad_value, mask_key=cfg.mask_key, lengths_key=cfg.lengths_key)
        if cfg.collate != "default"
        else None
    )
    transform = sample_transform(cfg)
    batch_transform = resolve_target(cfg.batch_transform, "data.batch_transform") if cfg.batch_transform else None

    run = LoaderOptions(
        batch_size,
        seed=seed,
        collate_fn=collate,
        pin_memory=device.type == "cuda",
        prefetch_factor=cfg.prefetch_factor,
        max_bad_fraction=cfg.max_bad_fraction,
        rank=rank,
        world_size=world_size,
    )

    def make(data: Any, num_workers: int, *, train: bool = True, batch_size: int | None = None) -> Loader:
        options = dataclasses.replace(
            run,
            batch_size=batch_size or run.batch_size,
            num_workers=num_workers,
            shuffle=cfg.shuffle and train,
            drop_last=cfg.drop_last and train,
        )
        common = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        if is_source(data):  # each rank streams its own units
            return StreamLoader(
                data, transform=transform, batch_transform=batch_transform, streams=cfg.streams, **common
            )
        key = id(data)  # the caller keeps train and val data alive: ids stay theirs
        if transform is not None:
            data = _Transformed(data, transform)
        loader = EpochLoader(
            data,
            bucket_by=_bucket_key(cfg.bucket_by),
            bucket_window=cfg.bucket_window,
            lengths=lengths.get(key),
            **common,
        )
        if cfg.bucket_by is not None:  # one pass over the samples, shared by the trial's loaders
            lengths[key] = loader.lengths()
        return loader

    lengths: dict[int, Any] = {}
    return make


def resolve_data(cfg: DataConfig, train_data: Any = None, val_data: Any = None) -> tuple[Any, Any]:
    """``train_data``/``val_data`` as given, or what the config names (datasets or sources)."""
    if train_data is not None:
        return train_data, val_data
    if cfg.format == "datasets":
        if cfg.train is None:
            raise ConfigError("data.format=datasets needs data.train: a save_to_disk directory or .arrow files")
        val = HFDiskDataset(cfg.val, cfg.columns, "data.val") if cfg.val is not None else None
        return HFDiskDataset(cfg.train, cfg.columns), val
    return build_datasets(cfg) if cfg.format == "map" else build_sources(cfg)


def build_loaders(
    cfg: DataConfig,
    *,
    batch_size: int,
    seed: int,
    device: torch.device,
    train_data: Any = None,
    val_data: Any = None,
    rank: int = 0,
    world_size: int = 1,
    val_batch_size: int | None = None,
) -> Loaders:
    """Loaders for ``train_data``/``val_data`` (datasets or sources), or those the config names;
    ``num_workers: auto`` runs (or reads from the cache) the worker trial on the training data.
    ``val_batch_size``: the validation loader's batch (``None``: ``batch_size``)."""
    per_rank(batch_size, world_size)
    if val_batch_size is not None and val_batch_size % world_size:
        raise ConfigError(
            f"val.batch_size {val_batch_size} does not divide by the world size {world_size}; "
            f"use a multiple of {world_size} (it is the batch of the whole job)"
        )
    train_data, val_data = resolve_data(cfg, train_data, val_data)
    make = loader_factory(cfg, batch_size=batch_size, seed=seed, device=device, rank=rank, world_size=world_size)
    tuning = None
    num_workers = cfg.num_workers
    if num_workers == "auto":
        with preserved_rng():  # the trial runs or not (the cache): the run must not depend on it
            tuning = tune_workers(
                lambda n: make(train_data, n),
                fingerprint=data_fingerprint(train_data, cfg, batch_size),
                limit=cfg.streams if is_source(train_data) else None,
                least=getattr(train_data, "min_workers", 0),
            )
        num_workers = tuning.num_workers
        if world_size > 1:  # the ranks share the machine's CPUs; streams must match on every rank
            num_workers = agree_min(num_workers, device)
    assert isinstance(num_workers, int)
    train = make(train_data, num_workers)
    val = make(val_data, num_workers, train=False, batch_size=val_batch_size) if val_data is not None else None
    empty = [*getattr(train_data, "empty_files", []), *getattr(val_data, "empty_files", [])]
    sources = {key: data for key, data in (("data.train", train_data), ("data.val", val_data)) if is_source(data)}
    # A batch transform may reshape the batch: then a sample says nothing about it.
    val_sample = None if cfg.batch_transform else first_sample(val_data, sample_transform(cfg))
    return Loaders(train, val, tuning, empty, sources, val_sample)


def first_sample(data: Any, transform: Callable[[Any], Any] | None = None) -> dict[str, torch.Tensor] | None:
    """A map-style dataset's first sample as the loader gives it (``transform``: the config's
    sample transform), its tensors by where they are (``sample[0]``); ``None`` for a streaming
    source, an empty dataset or a sample that cannot be read (the loader reports that one by
    index). The read changes no random generator: an augmenting dataset draws the same after it."""
    if data is None or is_source(data) or not len(data):
        return None
    with preserved_rng():
        try:
            sample = data[0]
            return dict(flat_tensors(transform(sample) if transform is not None else sample))
        except Exception:  # noqa: BLE001 - see above
            return None


def check_alike(batch: Any, sample: dict[str, torch.Tensor]) -> None:
    """A training batch against a validation sample: a feature width that differs would fail in
    the model only at the first validation, after an epoch.

    Compares the last axis of floating tensors found at the same place in both, with the batch's
    one axis more (features); integer tensors (token ids, labels) may differ in length.

    Raises:
        ConfigError: naming the tensor and both shapes.
    """
    for where, a in flat_tensors(batch):
        b = sample.get(where)
        if b is None or not (a.is_floating_point() and b.is_floating_point()) or a.dim() != b.dim() + 1:
            continue
        if b.dim() and a.shape[-1] != b.shape[-1]:
            raise ConfigError(
                f"the validation samples do not match the training samples: {where} has shape "
                f"{list(b.shape)} in the first validation sample, {list(a.shape[1:])} per sample in the "
                "first training batch; give both datasets the same features (columns, preprocessing)"
            )


def flat_tensors(sample: Any, where: str = "sample") -> list[tuple[str, torch.Tensor]]:
    """A sample's tensors (numpy arrays as tensors) with where each is (``sample[0]``, ``sample['x']``)."""
    if isinstance(sample, torch.Tensor):
        return [(where, sample)]
    if isinstance(sample, np.ndarray) and sample.dtype != object:
        return [(where, torch.from_numpy(sample))]
    if isinstance(sample, dict):
        return [t for key, value in sample.items() for t in flat_tensors(value, f"{where}[{key!r}]")]
    if isinstance(sample, (tuple, list)):
        return [t for i, value in enumerate(sample) for t in flat_tensors(value, f"{where}[{i}]")]
    return []


def sample_transform(cfg: DataConfig) -> Callable[[Any], Any] | None:
    """What each sample goes through: ``data.preprocess`` on its input, then ``data.transform``."""
    transform = resolve_target(cfg.transform, "data.transform") if cfg.transform else None
    if cfg.preprocess.mode is None:
        return transform

    return PreprocessInput(ImagePreprocess.from_spec(dataclasses.asdict(cfg.preprocess), "data.preprocess"), transform)


def transformed_datasets(cfg: DataConfig) -> tuple[Any, Any]:
    """The map-style datasets of the config, each sample as the training loader sees it."""
    train, val = build_datasets(cfg)
    transform = sample_transform(cfg)
    if transform is None:
        return train, val
    return _Transformed(train, transform), (_Transformed(val, transform) if val is not None else None)


class PreprocessInput:
    """Applies an image preprocess to a sample's input (a tuple's first item, a dict's ``input``)."""

    def __init__(self, preprocess: Callable[[Any], Any], then: Callable[[Any], Any] | None = None) -> None:
        self.preprocess, self.then = preprocess, then

    def __call__(self, sample: Any) -> Any:
        if isinstance(sample, dict):
            if "input" not in sample:
                raise KeyError(f"data.preprocess needs an 'input' key in dict samples; this one has {sorted(sample)}")
            sample = {**sample, "input": self.preprocess(sample["input"])}
        elif isinstance(sample, (tuple, list)):
            sample = (self.preprocess(sample[0]), *sample[1:])
        else:
            sample = self.preprocess(sample)
        return self.then(sample) if self.then is not None else sample


class _Transformed(torch.utils.data.Dataset):
    """A map-style dataset with ``data.transform`` applied to each item."""

    def __init__(self, dataset: Any, transform: Callable[[Any], Any]) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.transform(self.dataset[index])


def data_fingerprint(data: Any, cfg: DataConfig, batch_size: int) -> str:
    """Identifies the data and batch settings for the worker-count cache."""
    what = (
        data.fingerprint()
        if is_source(data) or callable(getattr(data, "fingerprint", None))
        else [f"{type(data).__module__}.{type(data).__qualname__}", len(data), cfg.target, cfg.args]
    )
    return json.dumps(
        [
            what,
            batch_size,
            cfg.collate,
            cfg.transform,
            cfg.batch_transform,
            cfg.prefetch_factor,
            cfg.streams,
            dataclasses.asdict(cfg.preprocess),
        ],
        default=str,
        sort_keys=True,
    )


def _bucket_key(key: str | None) -> str | int | None:
    return int(key) if key is not None and key.isdigit() else key


def _one(values: list[str]) -> str:
    if len(values) != 1:
        raise ConfigError(f"data.input for webdataset is one sample key, got {values}")
    return values[0]
