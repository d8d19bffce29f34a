"""The global random generators (python, numpy, torch CPU and CUDA): seed, read, restore, fence off.

``seed_everything(seed)`` seeds them all (the one copy of it: the run's seed, each rank's own
stream under torchrun).

A seeded run draws its numbers in a fixed order: seed, model init, then the training steps.
Anything that runs outside that order — the worker trial, a loader reading sample lengths, a
sample transform that augments — must not move those generators, or the first run on a machine
(which times its workers) differs from every later run (which reads the choice from a cache):

- ``preserved_rng()`` runs a block and puts every generator back as it was;
- ``isolated_rng(*key)`` runs a block on generators seeded from ``key`` alone and puts the
  caller's back afterwards — a batch's augmentations then depend on which batch it is, not on
  which process made it or what ran before; ``BatchSeeds`` does it for a loader's batches and
  learns which generators its data code draws from, so that the others cost nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device); optionally force determinism.

    ``deterministic=True`` turns on ``torch.use_deterministic_algorithms`` and deterministic
    cuDNN (no autotuning), and sets ``CUBLAS_WORKSPACE_CONFIG``, which cuBLAS reads to make its
    reductions deterministic. Data order and DataLoader workers are seeded by
    ``torchkeel.data.EpochLoader`` from the same seed (see ``torchkeel.data.seed_worker``).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def capture_rng() -> dict[str, Any]:
    """Python, numpy, torch CPU and every CUDA device's RNG state."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    """Inverse of ``capture_rng``. CUDA states are restored for as many devices as both sides have."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        for device, rng in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, device)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run the block, then put every global generator back as it was (also after an exception)."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)


@contextlib.contextmanager
def isolated_rng(*key: int) -> Iterator[None]:
    """Run the block with python, numpy and torch's CPU generator seeded from ``key`` only; the
    caller's states come back afterwards. CUDA generators are not touched (data code runs on
    the CPU). In a DataLoader worker, which draws nothing of its own between batches, nothing
    is saved and restored. Meant once per batch: about 25 µs in the training process.

    numpy's global generator is saved and seeded through its state struct (``ctypes``), as
    ``np.random.get_state`` alone costs 40 µs; its legacy cache of one gaussian is not part of
    that state, so a batch that draws an odd number of ``np.random.normal`` values leaves the
    caller's next one to be that batch's (a run stays deterministic; checkpoints save it).
    """
    seed = _mix(key)
    if get_worker_info() is not None:
        _seed_all(seed)
        yield
        return
    saved = {name: g.save() for name, g in _GENERATORS.items()}
    _seed_all(seed)
    try:
        yield
    finally:
        for name, state in saved.items():
            _GENERATORS[name].load(state)


def _seed_all(seed: int) -> None:
    for generator in _GENERATORS.values():
        generator.seed(seed)


class BatchSeeds:
    """``isolated_rng`` for the batches of one loader, which learns what its data code draws from.

    In the training process, saving and restoring python's generator costs about 15 µs a batch,
    numpy's and torch's a few: more than many a ``__getitem__``. So the first ``PROBE_BATCHES``
    batches also check which generators the data code moved; from then on only those are
    seeded, saved and restored, and a dataset that draws no random numbers costs nothing. (One
    whose first batches never draw from a generator but later ones do would then draw from the
    training process's own stream: still the same run for the same worker count, not for
    another.) In a worker, every generator is seeded for every batch, as ``isolated_rng`` does.

    Example::

        seeds = BatchSeeds()
        with seeds(seed, epoch, first_index):
            items = [dataset[i] for i in indices]
    """

    PROBE_BATCHES = 16

    def __init__(self) -> None:
        self._probed = 0
        self._drew: set[str] = set()
        self._active = list(_GENERATORS)
        self.idle_pid: int | None = None
        """The process that found the data code to draw from no generator: there nothing is seeded
        or restored (a caller may skip the context); a worker, forked or spawned, has another pid."""

    def __call__(self, *key: int) -> contextlib.AbstractContextManager[None]:
        if self.idle_pid == os.getpid():
            return _NOTHING
        return self._isolated(key)

    @contextlib.contextmanager
    def _isolated(self, key: tuple[int, ...]) -> Iterator[None]:
        seed = _mix(key)
        if get_worker_info() is not None:
            _seed_all(seed)
            yield
            return
        probing = self._probed < self.PROBE_BATCHES
        active = [_GENERATORS[name] for name in self._active]
        saved = [g.save() for g in active]
        for g in active:
            g.seed(seed)
        seeded = [g.save() for g in active] if probing else []
        try:
            yield
        finally:
            if probing:
                self._drew.update(name for name, g, before in zip(self._active, active, seeded) if not g.same(before))
            for g, state in zip(active, saved):
                g.load(state)
            if probing:
                self._probed += 1
                if self._probed == self.PROBE_BATCHES:
                    self._active = [name for name in self._active if name in self._drew]
                    self.idle_pid = os.getpid() if not self._active else None


class _PythonGlobal:
    def save(self) -> Any:
        return random.getstate()

    def load(self, state: Any) -> None:
        random.setstate(state)

    def seed(self, seed: int) -> None:
        random.seed(seed)

    def same(self, state: Any) -> bool:
        return random.getstate() == state


class _TorchGlobal:
    def save(self) -> torch.Tensor:
        return torch.get_rng_state()

    def load(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def seed(self, seed: int) -> None:
        torch.random.default_generator.manual_seed(seed)

    def same(self, state: torch.Tensor) -> bool:
        return torch.equal(torch.get_rng_state(), state)


class _NumpyGlobal:
    """numpy's global MT19937 state (``key[624]``, ``pos``), read and written as bytes."""

    KEY_WORDS = 624

    def __init__(self) -> None:
        generator = np.random.mtrand._rand._bit_generator
        self.is_mt = type(generator).__name__ == "MT19937"
        self.address = generator.ctypes.state_address if self.is_mt else 0
        self.size = 4 * self.KEY_WORDS + ctypes.sizeof(ctypes.c_int)
        self.steps = np.arange(1, self.KEY_WORDS // 2 + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        self.pos = self.KEY_WORDS.to_bytes(ctypes.sizeof(ctypes.c_int), sys.byteorder)

    def save(self) -> Any:
        if not self.is_mt:
            return np.random.get_state()
        buffer = (ctypes.c_char * self.size)()
        ctypes.memmove(buffer, self.address, self.size)
        return buffer

    def load(self, state: Any) -> None:
        if not self.is_mt:
            np.random.set_state(state)
            return
        ctypes.memmove(self.address, state, self.size)

    def seed(self, seed: int) -> None:
        """A key of 624 words expanded from ``seed`` (splitmix64), taken at its next draw."""
        if not self.is_mt:
            np.random.seed(seed % 2**32)
            return
        z = self.steps + np.uint64(seed)  # unsigned arithmetic wraps: splitmix64 of seed + k * golden
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        ctypes.memmove(self.address, z.tobytes() + self.pos, self.size)  # pos = 624: the next draw twists the new key

    def same(self, state: Any) -> bool:
        if not self.is_mt:
            current = np.random.get_state()
            return all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(current, state))
        return ctypes.string_at(self.address, self.size) == bytes(state)


_NUMPY = _NumpyGlobal()
_GENERATORS: dict[str, Any] = {"python": _PythonGlobal(), "numpy": _NUMPY, "torch": _TorchGlobal()}


_NOTHING = contextlib.nullcontext()


def _mix(key: tuple[int, ...]) -> int:
    """A 63-bit seed from a tuple of ints (splitmix64 over each): unrelated keys, unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for part in key:
        state = (state ^ (part % 2**64)) * 0xBF58476D1CE4E5B9 % 2**64
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB % 2**64
        state ^= state >> 29
    return state % 2**63
