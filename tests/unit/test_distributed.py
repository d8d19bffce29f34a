"""The single-process parts of distributed training: batch shares, sharding targets, activation
checkpointing, the sharded checkpoint layout, and the test seams. (Real torchrun runs: tests/dist.)"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchkeel as tk
from torchkeel.checkpoint.format import read_manifest
from torchkeel.checkpoint.sharded import read_full_weights, save_sharded
from torchkeel.data.loader import EpochLoader
from torchkeel.distributed import apply_activation_checkpointing, per_rank, shard_targets
from torchkeel.testing import parse_step_faults


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


@pytest.mark.parametrize("n,batch,world", [(100, 8, 2), (101, 12, 4), (6, 8, 4), (7, 6, 3)])
def test_every_rank_takes_its_slice_of_each_global_batch_exactly_once(n, batch, world):
    loaders = [EpochLoader(_dataset(n), batch, seed=1, rank=r, world_size=world) for r in range(world)]
    single = EpochLoader(_dataset(n), batch, seed=1)
    for epoch in range(2):
        per_rank_batches = [list(loader.epoch(epoch)) for loader in loaders]
        assert len({len(b) for b in per_rank_batches}) == 1  # the same number of batches on every rank
        assert len(per_rank_batches[0]) == len(single)
        for number, whole in enumerate(single.epoch(epoch)):
            parts = [per_rank_batches[r][number][1] for r in range(world)]
            assert torch.equal(torch.cat(parts), whole[1])  # rank-major slices of the one global batch
            sizes = [p.numel() for p in parts]
            assert max(sizes) - min(sizes) <= 1  # a short batch is split as evenly as possible


def test_resuming_mid_epoch_continues_each_rank_share():
    full = [list(EpochLoader(_dataset(50), 8, seed=2, rank=r, world_size=2).epoch(0)) for r in range(2)]
    later = [list(EpochLoader(_dataset(50), 8, seed=2, rank=r, world_size=2).epoch(0, start_batch=3)) for r in range(2)]
    for r in range(2):
        assert all(torch.equal(a[1], b[1]) for a, b in zip(full[r][3:], later[r], strict=True))


def test_a_batch_that_does_not_divide_by_the_world_size_names_both_numbers():
    with pytest.raises(tk.ConfigError, match="train.batch_size 30 does not divide by the world size 4"):
        per_rank(30, 4)
    with pytest.raises(tk.ConfigError, match="world size 4"):
        EpochLoader(_dataset(10), 30, rank=0, world_size=4)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 2))


def test_default_shard_targets_are_the_repeated_blocks_and_names_are_checked():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Block(), nn.Linear(8, 2))
    assert [type(m).__name__ for m in shard_targets(model, [])] == ["Linear", "Block", "Linear"]  # no ReLU
    assert [type(m).__name__ for m in shard_targets(model, ["Block"])] == ["Block"]
    with pytest.raises(tk.ConfigError, match=r"dist.shard_modules: no module of class \['Blok'\]"):
        shard_targets(model, ["Blok"])


def test_activation_checkpointing_recomputes_without_changing_results_or_keys():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 2))
    checkpointed = nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 2))
    checkpointed.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(checkpointed, ["Block"]) == 2
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    calls = []
    checkpointed[1].linear.register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(5, 4)
    for model in (plain, checkpointed):
        model(x).square().sum().backward()
    assert len(calls) == 2  # the block ran again in the backward pass
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
    with pytest.raises(tk.ConfigError, match="activation_checkpointing"):
        apply_activation_checkpointing(plain, ["Missing"])


def test_a_sharded_checkpoint_in_one_process_is_verified_and_gives_full_weights(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    store = tk.CheckpointStore(tmp_path / "checkpoints")
    path = save_sharded(store, {"progress": {"step": 5}}, model, optimizer, step=5, epoch=0)
    manifest = read_manifest(path)
    assert manifest["layout"] == "sharded" and "shards/.metadata" in manifest["files"]
    found = tk.read_checkpoint(path)
    assert found.shards == path / "shards" and "model" not in found.state
    weights = read_full_weights(found.shards)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert set(tk.load_weights(path)) == set(model.state_dict())  # what keel export and init_from read
    shard = next((path / "shards").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))
    with pytest.raises(tk.CheckpointError, match="distcp' fails its xxh3_128 check"):
        tk.read_checkpoint(path)
    manifest["files"].pop("shards/.metadata")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(tk.CheckpointError, match="lacks its step or file list"):
        tk.read_checkpoint(path)


def test_step_faults_apply_only_to_their_rank_and_restart(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    hook = parse_step_faults("oom:4@rank=1,kill:1@rank=1@restart=1,kill:1@rank=0")
    hook(4)  # the kills are for restart 1 and for rank 0: not this process
    with pytest.raises(torch.OutOfMemoryError):
        hook(5)
    with pytest.raises(ValueError, match="unknown step fault"):
        parse_step_faults("explode:1")


def test_sync_batchnorm_is_a_checked_dist_key(tmp_path):
    from torchkeel.config import load_config

    assert load_config(None, []).dist.sync_batchnorm is False
    assert load_config(None, ["dist.sync_batchnorm=true"]).dist.sync_batchnorm is True
    path = tmp_path / "cfg.yaml"
    path.write_text("dist: {sync_batchnorm: maybe}\n")
    with pytest.raises(tk.ConfigError, match=r"dist.sync_batchnorm must be true or false"):
        load_config(path)


def _normalized() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4),
        nn.Flatten(start_dim=2),
        nn.BatchNorm1d(4, momentum=None),
        nn.Unflatten(2, (2, 2, 1)),
        nn.BatchNorm3d(4, affine=False),
    )


def test_synced_batch_norms_keep_the_parameters_buffers_and_keys_and_compute_the_same_in_one_process():
    from torchkeel.distributed import BatchNormUse, sync_batch_norms

    model, plain = _normalized(), _normalized()
    before = list(model.parameters()) + list(model.buffers())
    assert BatchNormUse.of(model).row() == {"batch_norm": "per_rank", "batch_norm_layers": 3}
    assert sync_batch_norms(model, torch.device("cpu")) == 3
    assert all(a is b for a, b in zip(before, list(model.parameters()) + list(model.buffers()), strict=True))
    assert BatchNormUse.of(model).row() == {"batch_norm": "synced", "batch_norm_layers": 3}
    assert list(model.state_dict()) == list(plain.state_dict())  # checkpoints load both ways
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())
    x = torch.randn(6, 3, 2, 2)
    for mode in (True, False):  # one process: the batch's own statistics, then the running ones
        assert torch.equal(model.train(mode)(x), plain.train(mode)(x))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), plain.buffers(), strict=True))


def test_a_batch_norm_with_a_forward_of_its_own_is_refused_naming_the_key():
    from torchkeel.distributed import sync_batch_norms

    class NormAct(nn.BatchNorm1d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(super().forward(x))

    with pytest.raises(tk.ConfigError, match=r"dist.sync_batchnorm: NormAct subclass .* dist.sync_batchnorm: false"):
        sync_batch_norms(nn.Sequential(nn.Linear(2, 3), NormAct(3)), torch.device("cpu"))


@pytest.mark.parametrize(
    "layers,row,warns",
    [
        ((nn.Linear(2, 2),), {}, False),
        ((nn.BatchNorm1d(2),), {"batch_norm": "per_rank", "batch_norm_layers": 1}, True),
        ((nn.SyncBatchNorm(2),), {"batch_norm": "synced", "batch_norm_layers": 1}, False),
        ((nn.SyncBatchNorm(2), nn.BatchNorm1d(2)), {"batch_norm": "per_rank", "batch_norm_layers": 1}, True),
    ],
)
def test_the_start_note_names_batch_norms_that_normalize_per_rank(layers, row, warns):
    from torchkeel.distributed import BatchNormUse

    use = BatchNormUse.of(nn.Sequential(*layers))
    assert use.row() == row
    warning = use.warning(batch_size=64, world_size=2)
    assert (warning is not None) == warns
    assert warning is None or "32 samples, not the job's 64" in warning and "dist.sync_batchnorm: true" in warning
