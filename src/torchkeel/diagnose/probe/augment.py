"""Random augmentation where it does harm: in an evaluation loader (a sample differs from one read
to the next), and in the DataLoader's workers when the dataset holds its own generator (each
worker gets a copy of the same state, so they all draw the same numbers).

Called by the loader listener with a loader's first batch; every random generator is put back
as it was, so the script draws what it would have drawn.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

_GENERATORS = (np.random.Generator, np.random.RandomState, random.Random, torch.Generator)
_WRAPPERS = ("dataset", "datasets", "transform", "transforms", "target_transform")


def random_per_read(dataset: Any) -> bool:
    """Whether reading sample 0 twice gives two different samples (random transforms), with the
    random generators as they were before, after."""
    try:
        if len(dataset) < 1:
            return False
    except TypeError:
        return False  # an iterable dataset: no sample to read twice
    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    own = [(g, _state(g)) for _, g in _held(dataset)]  # the dataset's own generators are put back too
    try:
        first, second = dataset[0], dataset[0]
    except Exception:  # noqa: BLE001 - a sample that cannot be read here is the script's to find
        return False
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        for generator, state in own:
            _restore(generator, state)
    return not _same(first, second)


def own_generators(dataset: Any) -> list[str]:
    """``Class.attribute (type)`` of the random generators a dataset (or its transforms, or the
    dataset it wraps) holds as attributes."""
    return [f"{where} ({type(g).__module__}.{type(g).__name__})" for where, g in _held(dataset)]


def _held(dataset: Any, depth: int = 3) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> None:
        if id(obj) in seen or level > depth or not hasattr(obj, "__dict__"):
            return
        seen.add(id(obj))
        for name, value in vars(obj).items():
            if isinstance(value, _GENERATORS):
                found.append((f"{type(obj).__name__}.{name}", value))
            elif name in _WRAPPERS:
                for inner in value if isinstance(value, (list, tuple)) else (value,):
                    visit(inner, level + 1)

    visit(dataset, 0)
    return found


def _state(generator: Any) -> Any:
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, np.random.RandomState):
        return generator.get_state()
    if isinstance(generator, random.Random):
        return generator.getstate()
    return generator.get_state()  # torch.Generator


def _restore(generator: Any, state: Any) -> None:
    if isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    else:
        generator.set_state(state)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects that cannot be compared (PIL images compare fine)
        return True
