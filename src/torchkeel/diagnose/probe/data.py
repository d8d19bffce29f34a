"""Data loading: the DataLoader iterator, timed. How long the loop waited on each loader, with
the first batch of a worker-backed iterator counted apart (it includes starting the workers)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import RandomSampler, SequentialSampler, dataloader

from torchkeel.diagnose.events import AugmentationInEvaluation, GeneratorInWorkers
from torchkeel.diagnose.probe.augment import own_generators, random_per_read
from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe


class LoaderListener:
    """Wraps ``DataLoader.__iter__`` (which loader) and its iterator's ``__next__`` (how long)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.loaders: dict[int, dict[str, Any]] = {}
        self.loader_of: dict[int, dict[str, Any]] = {}
        self.started_iters: weakref.WeakSet = weakref.WeakSet()
        self.startup_s = 0.0
        self.wait_s = 0.0
        self.first_batch_at: float | None = None
        self.last_batch_at = 0.0

    def install(self) -> None:
        iterator = dataloader._BaseDataLoaderIter
        self.probe.patch(iterator, "__next__", self._timed_next(iterator.__next__))
        self.probe.patch(dataloader.DataLoader, "__iter__", self._noting_iter(dataloader.DataLoader.__iter__))

    def _timed_next(self, original: Callable) -> Callable:
        listener, probe = self, self.probe

        def __next__(it: Any) -> Any:
            start = time.perf_counter()
            probe.state.in_fetch = True
            try:
                batch = original(it)
                if not probe.light:
                    probe.emit("fetched")
                    info = listener.loader_of.get(id(it))
                    if info is not None and not info.get("checked"):
                        info["checked"] = True
                        probe.safely(listener._check_augmentation, it, info)
                return batch
            finally:
                probe.state.in_fetch = False
                waited = time.perf_counter() - start
                listener.wait_s += waited
                if listener.first_batch_at is None:
                    listener.first_batch_at, probe.state.overhead_s = start, 0.0
                listener.last_batch_at = time.perf_counter()
                listener._note_loader(it, waited)

        return __next__

    def _noting_iter(self, original: Callable) -> Callable:
        listener = self

        def __iter__(loader: Any) -> Any:
            it = original(loader)
            if id(loader) not in listener.loaders:
                try:
                    size = len(loader.dataset)
                except TypeError:
                    size = None
                listener.loaders[id(loader)] = {
                    "dataset_class": type(loader.dataset).__name__,
                    "dataset_size": size,
                    "batch_size": loader.batch_size,
                    "drop_last": loader.drop_last,
                    "num_workers": loader.num_workers,
                    "shuffle": _shuffles(loader.sampler),
                    "batches": 0,
                    "wait_s": 0.0,
                    "epochs": 0,
                    "length": _length(loader),
                }
            listener.loaders[id(loader)]["epochs"] += 1
            listener.loader_of[id(it)] = listener.loaders[id(loader)]
            return it

        return __iter__

    def _note_loader(self, it: Any, waited: float) -> None:
        info = self.loader_of.get(id(it))
        if info is None:
            return
        self.probe.state.last_loader = info
        if info["num_workers"] and it not in self.started_iters:
            # The first batch of an iterator includes starting its workers: counted apart, as
            # startup, not as the Dataset's speed.
            self.started_iters.add(it)
            self.startup_s += waited
            info["startup_s"] = info.get("startup_s", 0.0) + waited
            return
        info["batches"] += 1
        info["wait_s"] += waited

    def _check_augmentation(self, it: Any, info: dict[str, Any]) -> None:
        """A loader's first batch: random samples in an evaluation loader (fetched without
        gradients, or with every model in eval mode), and a generator of the dataset's own copied
        into several workers."""
        probe, dataset = self.probe, it._dataset
        models = [m for m, _ in probe.state.roots.values()]
        evaluating = not torch.is_grad_enabled() or (models and not any(m.training for m in models))
        site = user_site() or {}
        if evaluating and random_per_read(dataset):
            probe.record(
                "augmentation-in-evaluation",
                AugmentationInEvaluation(dataset_class=type(dataset).__name__, step=probe.next_step, **site),
            )
        if it._num_workers >= 2 and getattr(it, "_worker_init_fn", None) is None:
            generators = own_generators(dataset)
            if generators:
                probe.record(
                    "generator-in-workers",
                    GeneratorInWorkers(
                        dataset_class=type(dataset).__name__,
                        num_workers=it._num_workers,
                        generators=generators[:5],
                        **site,
                    ),
                )

    def finish(self) -> None:
        probe = self.probe
        loop = (
            self.last_batch_at - self.first_batch_at - probe.state.overhead_s - self.startup_s
            if self.first_batch_at
            else 0.0
        )
        probe.facts.data = {
            "wait_s": self.wait_s - self.startup_s,
            "startup_s": self.startup_s,
            "loaders": list(self.loaders.values()),
            "loop_s": max(0.0, loop),
        }


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an iterable dataset without __len__
        return None


def _shuffles(sampler: Any) -> bool | None:
    """Whether a loader's sampler visits the dataset in a random order (None: a custom sampler)."""
    if isinstance(sampler, RandomSampler):
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    shuffle = getattr(sampler, "shuffle", None)  # DistributedSampler
    return shuffle if isinstance(shuffle, bool) else None
