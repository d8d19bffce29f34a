"""Data loading: reproducible, resumable epoch order and seeded workers."""

from torchkeel.data.loader import EpochLoader, epoch_seed, num_samples, seed_worker, to_device

__all__ = ["EpochLoader", "epoch_seed", "num_samples", "seed_worker", "to_device"]
