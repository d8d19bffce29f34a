"""Data: map-style and streaming loaders with a seeded, resumable, exactly-once order; sources
(Parquet, WebDataset, text); collate functions; the worker-count trial."""

from torchkeel._lazy import lazy_exports

_EXPORTS = {
    "DefaultCollate": "torchkeel.data.collate",
    "EpochLoader": "torchkeel.data.loader",
    "HFDiskDataset": "torchkeel.data.sources.hfdatasets",
    "LoaderOptions": "torchkeel.data.options",
    "PadCollate": "torchkeel.data.collate",
    "ParquetSource": "torchkeel.data.sources.parquet",
    "StreamLoader": "torchkeel.data.stream",
    "TextSource": "torchkeel.data.sources.text",
    "TuneResult": "torchkeel.data.tune",
    "WebDatasetSource": "torchkeel.data.sources.webdataset",
    "epoch_seed": "torchkeel.data.order",
    "num_samples": "torchkeel.batch",
    "seed_worker": "torchkeel.data.loader",
    "to_device": "torchkeel.batch",
    "tune_workers": "torchkeel.data.tune",
}

__all__ = [
    "DefaultCollate",
    "EpochLoader",
    "HFDiskDataset",
    "LoaderOptions",
    "PadCollate",
    "ParquetSource",
    "StreamLoader",
    "TextSource",
    "TuneResult",
    "WebDatasetSource",
    "epoch_seed",
    "num_samples",
    "seed_worker",
    "to_device",
    "tune_workers",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
