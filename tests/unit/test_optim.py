"""The built-in optimizers: the fused kernel where torch has one for the parameters, else multi-tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torchkeel.config.schema import OptimConfig
from torchkeel.train.optim import build_optimizer


def test_plain_cpu_parameters_get_the_fused_update():
    for name in ("sgd", "adamw"):
        optimizer = build_optimizer(OptimConfig(name=name, lr=0.1), torch.nn.Linear(4, 2).parameters())
        assert optimizer.defaults["fused"] is True, name


@pytest.mark.parametrize("name, fused", [("sgd", False), ("adamw", True)])
def test_sharded_parameters_get_a_kernel_that_steps_them(name, fused):
    """FSDP2's parameters are DTensors: fused SGD has no sharding rule for them (its step raises
    NotImplementedError), fused AdamW has."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh))
        optimizer = build_optimizer(OptimConfig(name=name, lr=0.1), [weight])
        assert bool(optimizer.defaults.get("fused")) is fused and (fused or optimizer.defaults["foreach"])
        weight.grad = distribute_tensor(torch.ones(4, 2), mesh)
        optimizer.step()
        assert torch.allclose(weight.full_tensor(), torch.full((4, 2), 0.9), atol=0.02)
    finally:
        dist.destroy_process_group()
