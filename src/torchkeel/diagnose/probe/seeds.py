"""Seeding: every call of the seed functions (where, with what), and whether the script drew
from Python's and NumPy's global RNGs at all (a seed that matters must be set)."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchkeel.introspect.sites import user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe


class SeedListener:
    """Wraps ``random.seed``, ``numpy.random.seed``/``default_rng`` and ``torch.manual_seed``."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.seeds = probe.facts.seeds

    def install(self) -> None:
        calls = self.seeds.setdefault("calls", [])

        def wrap(label: str, original: Callable) -> Callable:
            def seed(*args: Any, **kwargs: Any) -> Any:
                value = args[0] if args else kwargs.get("seed")
                calls.append(
                    {
                        "function": label,
                        "seeded": value is not None,
                        "site": user_site(sys._getframe(1)),
                        "value": value if isinstance(value, (int, float, str)) or value is None else repr(value)[:80],
                    }
                )
                result = original(*args, **kwargs)
                if label == "random.seed":
                    self.seeds["random_start"] = random.getstate()
                elif label == "numpy.random.seed":
                    self.seeds["numpy_start"] = np.random.get_state()[1].tobytes()
                return result

            return seed

        patch = self.probe.patch
        patch(random, "seed", wrap("random.seed", random.seed))
        patch(np.random, "seed", wrap("numpy.random.seed", np.random.seed))
        patch(np.random, "default_rng", wrap("numpy.random.default_rng", np.random.default_rng))
        patch(torch, "manual_seed", wrap("torch.manual_seed", torch.manual_seed))
        patch(torch.random, "manual_seed", wrap("torch.manual_seed", torch.random.manual_seed))

    def note_start(self) -> None:
        """The global RNGs' states before the script runs (compared at the end)."""
        self.seeds["random_start"] = random.getstate()
        self.seeds["numpy_start"] = np.random.get_state()[1].tobytes()

    def finish(self) -> None:
        self.seeds["random_used"] = random.getstate() != self.seeds.pop("random_start")
        self.seeds["numpy_used"] = np.random.get_state()[1].tobytes() != self.seeds.pop("numpy_start")
