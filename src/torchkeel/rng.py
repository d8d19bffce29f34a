"""The global random generators (python, numpy, torch CPU and CUDA): read, restore, fence off.

A seeded run draws its numbers in a fixed order: seed, model init, then the training steps.
Anything that runs outside that order — the worker trial, a loader reading sample lengths, a
sample transform that augments — must not move those generators, or the first run on a machine
(which times its workers) differs from every later run (which reads the choice from a cache):

- ``preserved_rng()`` runs a block and puts every generator back as it was;
- ``isolated_rng(*key)`` runs a block on generators seeded from ``key`` alone and puts the
  caller's back afterwards — a batch's augmentations then depend on which batch it is, not on
  which process made it or what ran before.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info


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
    python, numpy_state, torch_state = random.getstate(), _NUMPY.save(), torch.get_rng_state()
    _seed_all(seed)
    try:
        yield
    finally:
        random.setstate(python)
        _NUMPY.load(numpy_state)
        torch.set_rng_state(torch_state)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    _NUMPY.seed(seed)
    torch.random.default_generator.manual_seed(seed)


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


_NUMPY = _NumpyGlobal()


def _mix(key: tuple[int, ...]) -> int:
    """A 63-bit seed from a tuple of ints (splitmix64 over each): unrelated keys, unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for part in key:
        state = (state ^ (part % 2**64)) * 0xBF58476D1CE4E5B9 % 2**64
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB % 2**64
        state ^= state >> 29
    return state % 2**63
