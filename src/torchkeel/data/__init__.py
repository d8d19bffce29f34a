"""Data: map-style and streaming loaders with a seeded, resumable, exactly-once order; sources
(Parquet, WebDataset); collate functions; the worker-count trial."""

from torchkeel.data.batch import num_samples, to_device
from torchkeel.data.collate import DefaultCollate, PadCollate
from torchkeel.data.loader import EpochLoader, seed_worker
from torchkeel.data.order import epoch_seed
from torchkeel.data.sources.parquet import ParquetSource
from torchkeel.data.sources.webdataset import WebDatasetSource
from torchkeel.data.stream import StreamLoader
from torchkeel.data.tune import TuneResult, tune_workers

__all__ = ["DefaultCollate", "EpochLoader", "PadCollate", "ParquetSource", "StreamLoader", "TuneResult",
           "WebDatasetSource", "epoch_seed", "num_samples", "seed_worker", "to_device", "tune_workers"]
