"""The checkpoint component on its own: round trip, pruning, async, verification, safe loading."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import torchkeel.checkpoint as ck
from torchkeel.checkpoint.codec import decode, encode
from torchkeel.errors import CheckpointError


def trained(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def test_round_trip_restores_everything_bitwise(tmp_path):
    model, opt, sched = trained()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    store = ck.CheckpointStore(tmp_path)
    store.save(ck.capture_training_state(model, opt, sched, progress={"step": 3, "epoch": 0}), step=3, epoch=0)
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))
    model2, opt2, sched2 = trained(seed=1)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    found, problems = store.latest_valid()
    assert problems == [] and found.step == 3
    progress = ck.restore_training_state(found.state, model2, opt2, sched2)
    assert progress == {"step": 3, "epoch": 0}
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    for (ka, a), (kb, b) in zip(opt.state_dict()["state"].items(), opt2.state_dict()["state"].items()):
        assert ka == kb and all(torch.equal(a[k], b[k]) for k in a)
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert sched2.state_dict()["last_epoch"] == 3
    draws = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[:2] == expected_draws[:2] and torch.equal(draws[2], expected_draws[2])


def test_codec_keeps_python_types_and_refuses_pickle_only_objects():
    state = {"t": torch.ones(2), "tup": (1, (2.5, None)), 3: "int key", "arr": np.arange(3, dtype=np.uint32)}
    data, tensors = encode(state)
    json.dumps(data)  # plain JSON
    back = decode(json.loads(json.dumps(data)), tensors)
    assert back["tup"] == (1, (2.5, None)) and back[3] == "int key"
    assert back["arr"].dtype == np.uint32 and back["arr"].tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="cannot store set at 'x' without pickle"):
        encode({"x": {1, 2}})


def test_tied_weights_are_saved(tmp_path):
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    store = ck.CheckpointStore(tmp_path)
    store.save({"model": model.state_dict()}, step=1, epoch=0)
    assert torch.equal(store.latest_valid()[0].state["model"]["1.weight"], model[0].weight)


def test_pruning_keeps_last_and_best(tmp_path):
    store = ck.CheckpointStore(tmp_path, keep_last=2, save_top_k=1, monitor="val_loss", mode="min")
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.6, 5: 0.7}
    (tmp_path / "step-00000099").mkdir(parents=True)  # a write killed before its manifest
    for step, loss in losses.items():
        store.save({"model": {"w": torch.zeros(1)}}, step=step, epoch=0, metrics={"val_loss": loss})
    assert [s for s, _ in store.steps()] == [5, 4, 2]
    maximize = ck.CheckpointStore(tmp_path / "max", keep_last=1, save_top_k=3, mode="max")
    for step, loss in losses.items():
        maximize.save({"model": {"w": torch.zeros(1)}}, step=step, epoch=0, metrics={"val_loss": loss})
    assert [s for s, _ in maximize.steps()] == [5, 4, 1]


def test_async_saver_writes_a_copy_and_reports_errors(tmp_path):
    store = ck.CheckpointStore(tmp_path)
    saver = ck.AsyncSaver(store)
    weights = {"w": torch.zeros(1000)}
    saver.save({"model": weights}, step=1, epoch=0)
    weights["w"].add_(1)  # the loop goes on changing the live tensors
    saver.wait()
    assert torch.equal(store.latest_valid()[0].state["model"]["w"], torch.zeros(1000))
    saver.save({"model": {"bad": object()}}, step=2, epoch=0)
    with pytest.raises(TypeError, match="without pickle"):
        saver.wait()


def test_changed_model_lists_missing_unexpected_and_mismatched(tmp_path):
    model, opt, _ = trained()
    store = ck.CheckpointStore(tmp_path)
    store.save(ck.capture_training_state(model, opt), step=1, epoch=0)
    other = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    other.add_module("head", nn.Linear(4, 2))
    other[0] = nn.Identity()
    state = store.latest_valid()[0].state
    with pytest.raises(CheckpointError) as info:
        ck.restore_training_state(state, other)
    message = str(info.value)
    assert "missing: head.bias, head.weight" in message
    assert "unexpected: 0.bias, 0.weight" in message
    assert "shape mismatch: 2.bias (checkpoint (3,), model (4,)), 2.weight (checkpoint (3, 8), model (4, 8))" in message
    skipped = ck.load_model_weights(other, state["model"], strict=False, source="x")
    assert len(skipped) == 6


# --- corruption table -------------------------------------------------------------------------


def _truncate(n):
    return lambda b: b[:n] if n >= 0 else b[: len(b) + n]


def _flip(offset):
    def corrupt(b):
        i = offset if offset >= 0 else len(b) + offset
        return b[:i] + bytes([b[i] ^ 0x01]) + b[i + 1 :]

    return corrupt


def _zero_page(b):
    start = min(4096, len(b) // 2)
    return b[:start] + bytes(min(4096, len(b) - start)) + b[start + 4096 :]


def _hostile_header(b):
    return struct.pack("<Q", 2**62) + b[8:]


def _header_points_past_end(b):
    size = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + size])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10**9]
    text = json.dumps(header).encode().ljust(size)
    return (
        b[:8] + text[:size] + b[8 + size :]
        if len(text) == size
        else struct.pack("<Q", len(text)) + text + b[8 + size :]
    )


CASES = [
    (f, name, corrupt, check)
    for f in ("model.safetensors", "state.safetensors", "state.json")
    for name, corrupt, check in [
        ("empty", _truncate(0), "bytes"),
        ("one-byte", _truncate(1), "bytes"),
        ("half", lambda b: b[: len(b) // 2], "bytes"),
        ("size-1", _truncate(-1), "bytes"),
        ("flip-header", _flip(10), "xxh3_128"),
        ("flip-data", _flip(-3), "xxh3_128"),
        ("zero-page", _zero_page, "xxh3_128"),
    ]
] + [
    ("model.safetensors", "hostile-header-len", _hostile_header, "xxh3_128"),
    ("state.safetensors", "hostile-header-len", _hostile_header, "xxh3_128"),
    ("model.safetensors", "deleted", None, "missing"),
]


@pytest.fixture
def two_checkpoints(tmp_path):
    model, opt, sched = trained()
    store = ck.CheckpointStore(tmp_path / "ckpts", keep_last=5)
    store.save(ck.capture_training_state(model, opt, sched, progress={"step": 1}), step=1, epoch=0)
    store.save(ck.capture_training_state(model, opt, sched, progress={"step": 2}), step=2, epoch=0)
    return store


@pytest.mark.parametrize(("file", "name", "corrupt", "check"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_corrupt_file_is_named_and_skipped(two_checkpoints, file, name, corrupt, check):
    store = two_checkpoints
    target = store.path_for(2) / file
    if corrupt is None:
        target.unlink()
    else:
        target.write_bytes(corrupt(target.read_bytes()))
    with pytest.raises(CheckpointError) as info:
        ck.read_checkpoint(store.path_for(2))
    assert str(target) in str(info.value) and check in str(info.value)
    found, problems = store.latest_valid()
    assert found.step == 1 and len(problems) == 1 and str(target) in problems[0]


@pytest.mark.parametrize(
    ("name", "mutate", "message"),
    [
        ("missing", lambda p: p.unlink(), "manifest.json is missing"),
        ("empty", lambda p: p.write_text(""), "is unreadable"),
        ("not-json", lambda p: p.write_bytes(b"\x00\xff{"), "is unreadable"),
        (
            "wrong-version",
            lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "format_version": 9})),
            "not a torchkeel manifest of format 1 or 2",
        ),
        (
            "no-files",
            lambda p: p.write_text(json.dumps({k: v for k, v in json.loads(p.read_text()).items() if k != "files"})),
            "lacks its step or file list",
        ),
        ("wrong-hash", lambda p: p.write_text(p.read_text().replace('"xxh3_128": "', '"xxh3_128": "0', 1)), "xxh3_128"),
        ("wrong-size", lambda p: p.write_text(json.dumps(_resize(json.loads(p.read_text())))), "the manifest says"),
        ("list", lambda p: p.write_text("[1, 2]"), "not a torchkeel manifest"),
    ],
)
def test_bad_manifest_is_named_and_skipped(two_checkpoints, name, mutate, message):
    store = two_checkpoints
    manifest = store.path_for(2) / "manifest.json"
    mutate(manifest)
    with pytest.raises(CheckpointError, match=message):
        ck.read_checkpoint(store.path_for(2))
    assert store.latest_valid()[0].step == 1


def _resize(manifest):
    manifest["files"]["state.json"]["bytes"] += 1
    return manifest


def test_hostile_header_with_a_matching_manifest_is_a_typed_error(two_checkpoints):
    """Someone rewrote the manifest to match a crafted file: the parser still fails cleanly."""
    from torchkeel.checkpoint.format import file_digest

    store = two_checkpoints
    for corrupt, file in ((_hostile_header, "model.safetensors"), (_header_points_past_end, "state.safetensors")):
        path = store.path_for(2) / file
        manifest_path = store.path_for(2) / "manifest.json"
        original, original_manifest = path.read_bytes(), manifest_path.read_text()
        data = corrupt(original)
        path.write_bytes(data)
        manifest = json.loads(original_manifest)
        manifest["files"][file] = {"bytes": len(data), "xxh3_128": file_digest(path)}
        manifest_path.write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=f"'{path}' is not valid safetensors"):
            ck.read_checkpoint(store.path_for(2))
        path.write_bytes(original)
        manifest_path.write_text(original_manifest)


# --- format 2 on disk, format 1 still read, memory bounds ------------------------------------

V1 = Path(__file__).resolve().parents[1] / "data" / "checkpoint-v1" / "step-00000003"


def test_a_format_1_checkpoint_still_loads_and_resumes_exactly():
    """Written by the format-1 code (sha256, whole files) and committed; restored bitwise into a
    model and optimizer of the same structure. The expected values are the checkpoint's own
    tensors, read with safetensors: weights retrained here would differ on another CPU."""
    import safetensors.torch

    found = ck.read_checkpoint(V1)
    assert found.manifest["format_version"] == 1 and found.step == 3
    weights = safetensors.torch.load_file(str(V1 / "model.safetensors"))
    saved = safetensors.torch.load_file(str(V1 / "state.safetensors"))
    model, opt, sched = trained(seed=1)
    assert ck.restore_training_state(found.state, model, opt, sched) == {"step": 3, "epoch": 0}
    assert set(model.state_dict()) == set(weights)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    for index, state in opt.state_dict()["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], saved[f"optimizer/state/{index}/{key}"]), (index, key)
    assert sched.state_dict()["last_epoch"] == 3 and opt.param_groups[0]["lr"] == 0.0025
    # The run continues from there: the next step changes the restored weights.
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_corrupt_format_1_file_fails_its_sha256_check(tmp_path):
    import shutil

    copy = tmp_path / "step-00000003"
    shutil.copytree(V1, copy)
    data = bytearray((copy / "state.safetensors").read_bytes())
    data[-3] ^= 1
    (copy / "state.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state.safetensors' fails its sha256 check"):
        ck.read_checkpoint(copy)


def test_format_2_files_are_plain_safetensors_of_every_dtype(tmp_path):
    import safetensors.torch

    weights = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i8": torch.tensor([-3, 7], dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "u8": torch.arange(4, dtype=torch.uint8),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "i64": torch.tensor([2**40]),
    }
    path = ck.CheckpointStore(tmp_path).save({"model": weights}, step=1, epoch=0)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and set(manifest["files"]["model.safetensors"]) == {"bytes", "xxh3_128"}
    for loaded in (safetensors.torch.load_file(path / "model.safetensors"), ck.read_checkpoint(path).state["model"]):
        assert set(loaded) == set(weights)
        for name, tensor in weights.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with pytest.raises(TypeError, match="tensor 'c' of dtype torch.complex64"):
        ck.CheckpointStore(tmp_path / "bad").save(
            {"model": {"c": torch.zeros(2, dtype=torch.complex64)}}, step=1, epoch=0
        )


def test_saves_and_loads_stream_with_bounded_memory(tmp_path):
    """A 320 MB state: a sync save holds no copy of it, an async save one (its snapshot), a load
    with every byte verified no more than the state itself."""
    import gc

    from torchkeel.testing import peak_rss_during

    state = {"model": {f"w{i}": torch.randn(20 * 2**20 // 4 * 4 // 4) for i in range(16)}}  # 16 x 20 MB
    state_bytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    store = ck.CheckpointStore(tmp_path, keep_last=1, save_top_k=0)
    sync_peak, _ = peak_rss_during(lambda: store.save(state, step=1, epoch=0))
    saver = ck.AsyncSaver(store)
    async_peak, _ = peak_rss_during(lambda: (saver.save(state, step=2, epoch=0), saver.wait()))
    gc.collect()

    def load_and_touch():
        found = ck.read_checkpoint(store.path_for(2))
        assert [float(t.sum()) for t in found.state["model"].values()] == [
            float(t.sum()) for t in state["model"].values()
        ]
        return found

    load_peak, found = peak_rss_during(load_and_touch)
    for name, tensor in state["model"].items():
        assert torch.equal(found.state["model"][name], tensor)
    print(
        f"state {state_bytes / 2**20:.0f} MB; peak RSS above start: sync save {sync_peak / 2**20:.0f} MB, "
        f"async save {async_peak / 2**20:.0f} MB, load {load_peak / 2**20:.0f} MB"
    )
    assert sync_peak <= 0.10 * state_bytes, (sync_peak, state_bytes)
    assert async_peak <= 1.25 * state_bytes, (async_peak, state_bytes)
    assert load_peak <= 1.25 * state_bytes, (load_peak, state_bytes)


# --- foreign weights --------------------------------------------------------------------------


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "payload": _Exploit(marker)}, path)
    with pytest.raises(CheckpointError, match=r"refusing to load .*evil.pt.*disallowed global '(posix|nt)\.system'"):
        ck.load_weights(path)
    assert not marker.exists()


def test_foreign_state_dicts_load(tmp_path):
    model = nn.Linear(3, 2)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "wrapped.pth")
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    import safetensors.torch

    safetensors.torch.save_file(model.state_dict(), tmp_path / "w.safetensors")
    for name in ("wrapped.pth", "plain.pt", "w.safetensors"):
        weights = ck.load_weights(tmp_path / name)
        assert torch.equal(weights["weight"], model.weight)
    with pytest.raises(CheckpointError, match="not found"):
        ck.load_weights(tmp_path / "none.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="is not a readable torch file"):
        ck.load_weights(tmp_path / "junk.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="holds no state dict"):
        ck.load_weights(tmp_path / "list.pt")


def test_grad_scaler_state_round_trips(tmp_path):
    model, opt, _ = trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as the first backward does
    scaler.update(new_scale=256.0)
    store = ck.CheckpointStore(tmp_path)
    store.save(ck.capture_training_state(model, opt, scaler=scaler), step=1, epoch=0)
    restored = torch.amp.GradScaler("cpu")
    ck.restore_training_state(store.latest_valid()[0].state, model, opt, scaler=restored)
    assert restored.get_scale() == 256.0 and restored.get_growth_interval() == 7


def test_a_process_that_exits_right_after_a_prune_waits_for_the_removal(tmp_path):
    """The removal thread is not a daemon: a daemon cut off at interpreter shutdown can abort the
    process (a garbage collection in it reaches a tensor), and leaves the trash behind."""
    trash = tmp_path / "ckpt" / ".removing-step-00000001"
    for i in range(40):
        (trash / f"d{i}").mkdir(parents=True)
        for j in range(100):
            (trash / f"d{i}" / f"f{j}").write_bytes(b"x")
    script = f"import torchkeel.checkpoint as ck; ck.CheckpointStore(r'{tmp_path / 'ckpt'}').prune()"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not trash.exists()
