"""Reading a dataset's sample twice to see random transforms leaves every generator as it was."""

from __future__ import annotations

import random

import numpy as np
import torch

from torchkeel.diagnose.probe.augment import own_generators, random_per_read


class Noisy:
    def __init__(self) -> None:
        self.rng, self.gen = np.random.default_rng(0), torch.Generator().manual_seed(1)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(self.rng.normal() + random.random() + np.random.rand()) + torch.rand(1, generator=self.gen)


class Fixed:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3,), float(i)), i


def test_random_samples_are_seen_and_every_generator_is_put_back():
    data = Noisy()
    before = (
        data.rng.bit_generator.state,
        data.gen.get_state(),
        random.getstate(),
        np.random.get_state()[1].copy(),
        torch.random.get_rng_state(),
    )
    assert random_per_read(data)
    assert data.rng.bit_generator.state == before[0] and torch.equal(data.gen.get_state(), before[1])
    assert random.getstate() == before[2] and np.array_equal(np.random.get_state()[1], before[3])
    assert torch.equal(torch.random.get_rng_state(), before[4])
    assert not random_per_read(Fixed())
    assert own_generators(data) == ["Noisy.rng (numpy.random._generator.Generator)", "Noisy.gen (torch._C.Generator)"]
    assert own_generators(Fixed()) == []
