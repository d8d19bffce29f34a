"""The settings every loader shares, with one meaning each, checked in one place."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torchkeel.distributed.rank import per_rank


@dataclass(frozen=True)
class LoaderOptions:
    """What ``EpochLoader`` and ``StreamLoader`` are both told (``loader.options``).

    ``batch_size`` is always the job's batch: with ``world_size`` ranks, each collates
    ``rank_batch_size`` samples of it. ``shuffle`` and ``drop_last`` apply to the epoch's order;
    ``num_workers`` and ``prefetch_factor`` are DataLoader's; ``max_bad_fraction`` is the share of
    an epoch's samples that may fail before the epoch stops with a ``DataError``.

    Raises:
        ConfigError: ``batch_size`` does not divide by ``world_size``.
        ValueError: a count out of range (the field named).
    """

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    num_workers: int = 0
    collate_fn: Callable[[list[Any]], Any] | None = None
    pin_memory: bool = False
    prefetch_factor: int = 2
    start_method: str | None = None
    max_bad_fraction: float = 0.001
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        for name, low in (("batch_size", 1), ("num_workers", 0), ("prefetch_factor", 1), ("world_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")
        per_rank(self.batch_size, self.world_size)

    @classmethod
    def of(cls, arguments: Mapping[str, Any], **given: Any) -> LoaderOptions:
        """The options among a loader's ``arguments`` (its ``__init__``'s ``locals()``, read
        first thing), with ``given`` in place of what the loader settles itself."""
        return cls(**{**{name: arguments[name] for name in _FIELDS if name in arguments}, **given})

    @property
    def rank_batch_size(self) -> int:
        """The samples this rank collates of each batch."""
        return self.batch_size // self.world_size


class HasLoaderOptions:
    """Reads ``loader.options``' fields as the loader's own attributes (``loader.batch_size`` is
    ``loader.options.batch_size``): one copy of each setting, read where users expect it."""

    options: LoaderOptions

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options")  # not self.options: that would come back here when unset
        if options is not None and name in _NAMES:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_FIELDS = tuple(LoaderOptions.__dataclass_fields__)
_NAMES = frozenset(_FIELDS) | {"rank_batch_size"}
