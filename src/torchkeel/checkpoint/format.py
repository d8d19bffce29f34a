"""One checkpoint on disk: a directory of safetensors and JSON files, and a manifest written last.

Layout of ``step-00000120/``::

    model.safetensors   the model's state_dict (loadable by any safetensors reader)
    state.safetensors   every other tensor: optimizer moments, RNG states, ...
    state.json          everything else: structure, scalars, counters, python/numpy RNG
    manifest.json       step, epoch, metrics, versions, git commit, config hash, creation
                        time, and the size and xxh3-128 hash of every file above

A checkpoint is valid only if its manifest is present and every file matches its hash.
Safetensors has no checksum of its own, hence the manifest. Nothing here unpickles.

Format 2 (this one) streams each tensor file to disk, hashing the bytes on their way out, and
reads it back through a memory map after one hashing pass, so neither a save nor a load ever
holds a serialized copy of the state. The hash is xxh3-128: it guards against torn writes and
bit rot at memory speed (tens of GB/s); it is not a signature — whoever can rewrite a file can
rewrite the manifest too, which is why loading never runs code whatever the files hold.
Format 1 (sha256, whole files in memory) is still read.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from torchkeel.checkpoint.codec import decode, encode
from torchkeel.checkpoint.tensorfile import (
    CHUNK_BYTES,
    load_tensor_file,
    tensor_file_chunks,
)
from torchkeel.errors import CheckpointError, first_line
from torchkeel.io import fsync_dir, write_chunks_atomic, write_json_atomic

FORMAT_VERSION = 2
HASHES = {2: "xxh3_128", 1: "sha256"}  # format version → the hash its manifest holds per file
_HASHERS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
MANIFEST = "manifest.json"
MODEL_FILE, STATE_TENSORS, STATE_JSON = "model.safetensors", "state.safetensors", "state.json"
PointHook = Callable[[str], None]


@dataclass
class Checkpoint:
    """A verified checkpoint: its directory, manifest and decoded state."""

    path: Path
    manifest: dict[str, Any]
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def shards(self) -> Path | None:
        """The ``torch.distributed.checkpoint`` directory of a sharded (FSDP) checkpoint, else ``None``;
        its model and optimizer are not in ``state`` (see ``torchkeel.checkpoint.sharded``)."""
        return self.path / self.manifest["shards"] if self.manifest.get("layout") == "sharded" else None


def write_checkpoint(
    directory: str | Path,
    state: Mapping[str, Any],
    manifest: Mapping[str, Any],
    hook: PointHook | None = None,
    shards: str | None = None,
) -> Path:
    """Write ``state`` (whose ``"model"`` entry is the model's state_dict) into ``directory``.

    ``state`` may hold live tensors, on any device, shared or not: each is streamed to disk
    from its own memory (a device tensor through one CPU copy at a time), so the caller must
    not change them during the call — ``AsyncSaver`` hands over a ``snapshot``.
    ``manifest`` holds the descriptive fields; file hashes and the format version are added.
    An existing ``directory`` is replaced. The manifest is written last: a kill at any point
    before it leaves a directory that ``read_checkpoint`` rejects.

    ``shards`` names a subdirectory the ranks have already written (``torch.distributed.checkpoint``
    shards of the model and optimizer): the directory is kept, ``state`` has no ``"model"``, and
    the manifest vouches for every shard file too (layout ``sharded``).
    """
    target = Path(directory)
    if shards is None:
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
    fsync_dir(target.parent)
    model_json, model_tensors = encode(state["model"]) if shards is None else (None, {})
    rest_json, rest_tensors = encode({k: v for k, v in state.items() if k != "model"})
    structure = json.dumps({"model": model_json, "state": rest_json}).encode("utf-8")
    parts = {
        STATE_TENSORS: tensor_file_chunks(rest_tensors),
        STATE_JSON: (iter([memoryview(structure)]), len(structure)),
    }
    if shards is None:
        parts = {MODEL_FILE: tensor_file_chunks(model_tensors), **parts}
    algorithm = HASHES[FORMAT_VERSION]
    files = {}
    if shards is not None:
        for path in sorted((target / shards).rglob("*")):
            if path.is_file():
                files[path.relative_to(target).as_posix()] = {
                    "bytes": path.stat().st_size,
                    algorithm: file_digest(path, algorithm),
                }
    for name, (chunks, size) in parts.items():
        hasher = _HASHERS[algorithm]()
        # The temporary file lives beside the checkpoint directories, not in the new one: ext4
        # places a new directory's files in a fresh block group, and on thin-provisioned cloud
        # disks first writes to fresh blocks are several times slower than to reused ones.
        write_chunks_atomic(
            target / name, chunks, size, _prefixed(hook, name), hasher, sync_dir=False, temp_dir=target.parent
        )
        files[name] = {"bytes": size, algorithm: hasher.hexdigest()}
    fsync_dir(target)  # the files' names are durable before the manifest that vouches for them
    _point(hook, "before_manifest")
    layout = {} if shards is None else {"layout": "sharded", "shards": shards}
    write_json_atomic(
        target / MANIFEST,
        {
            "format_version": FORMAT_VERSION,
            **manifest,
            **layout,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files": files,
        },
    )
    _point(hook, "after_manifest")
    return target


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The parsed manifest, checked for the fields a checkpoint needs.

    Raises:
        CheckpointError: missing, unreadable or malformed manifest (the message names the file).
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{directory}' is incomplete: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint manifest '{path}' is unreadable ({type(exc).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") not in HASHES:
        raise CheckpointError(
            f"checkpoint manifest '{path}' is not a torchkeel manifest of format "
            f"{' or '.join(map(str, sorted(HASHES)))}"
        )
    files = manifest.get("files")
    shards = manifest.get("shards") if manifest.get("layout") == "sharded" else None
    if not isinstance(manifest.get("step"), int) or not isinstance(files, dict) or not _complete(set(files), shards):
        raise CheckpointError(f"checkpoint manifest '{path}' lacks its step or file list")
    return manifest


def _complete(files: set[str], shards: Any) -> bool:
    if shards is None:
        return files == {MODEL_FILE, STATE_TENSORS, STATE_JSON}
    inside = {f for f in files if isinstance(shards, str) and f.startswith(f"{shards}/") and ".." not in f}
    return files - inside == {STATE_TENSORS, STATE_JSON} and f"{shards}/.metadata" in inside


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """Verify every file against the manifest, then decode the state.

    Raises:
        CheckpointError: naming the file and the failed check (missing, size, sha256, parse).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint '{directory}' does not exist or is not a directory")
    manifest = read_manifest(directory)
    algorithm = HASHES[manifest["format_version"]]
    for name, entry in manifest["files"].items():
        _verify(directory / name, entry, algorithm)
    sharded = manifest.get("layout") == "sharded"
    model_tensors = {} if sharded else _load_tensors(directory / MODEL_FILE)
    rest_tensors = _load_tensors(directory / STATE_TENSORS)
    try:
        structure = json.loads((directory / STATE_JSON).read_bytes())
        state = decode(structure["state"], rest_tensors)
        if not sharded:
            state["model"] = decode(structure["model"], model_tensors)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint file '{directory / STATE_JSON}' does not match its tensors ({type(exc).__name__}: {exc})"
        ) from None
    return Checkpoint(directory, manifest, state)


def file_digest(path: str | Path, algorithm: str = HASHES[FORMAT_VERSION]) -> str:
    """The hex digest of a file's bytes, read in chunks (memory stays flat)."""
    hasher = _HASHERS[algorithm]()
    buffer = memoryview(bytearray(CHUNK_BYTES))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            hasher.update(buffer[:n])
    return hasher.hexdigest()


def _verify(path: Path, entry: Any, algorithm: str) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get(algorithm), str):
        raise CheckpointError(f"checkpoint manifest has no {algorithm} hash for '{path}'")
    try:
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(
                f"checkpoint file '{path}' has {size} bytes, the manifest says {entry.get('bytes')} (truncated?)"
            )
        digest = file_digest(path, algorithm)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file '{path}' is missing") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file '{path}' is unreadable ({exc.strerror})") from None
    if digest != entry[algorithm]:
        raise CheckpointError(f"checkpoint file '{path}' fails its {algorithm} check (corrupted)")


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_tensor_file(path)
    except Exception as exc:  # noqa: BLE001 - the library raises several types for bad headers
        raise CheckpointError(f"checkpoint file '{path}' is not valid safetensors ({first_line(exc)})") from None


def snapshot(state: Any, reuse: Any = None) -> Any:
    """A copy of ``state`` with every tensor detached, contiguous, on the CPU and unshared.

    An asynchronous save needs a copy the training loop cannot change under it. ``reuse`` is an
    earlier snapshot of the same structure that nobody reads any more: tensors of the same shape
    and dtype are copied into its memory, which skips allocating (and faulting in) a fresh copy.
    Those copies are made in one ``_foreach_copy_`` (one dispatch, not two per tensor).
    """
    into: list[tuple[torch.Tensor, torch.Tensor]] = []
    copy = _snapshot(state, reuse, into)
    if into:
        with torch.no_grad():
            torch._foreach_copy_([dst for dst, _ in into], [src for _, src in into])
    return copy


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SCALARS = frozenset({int, float, bool, str, type(None)})


def _snapshot(state: Any, reuse: Any, into: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """``snapshot``'s walk; plain tensors with memory to reuse are added to ``into``, to copy."""
    if isinstance(state, torch.Tensor):
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.is_cpu
            and reuse.dtype == state.dtype
            and reuse.shape == state.shape
        ):
            if type(reuse) is torch.Tensor and type(state) in _PLAIN:
                into.append((reuse, state))
                return reuse
            return reuse.copy_(state.detach())  # a tensor subclass (DTensor) copies itself
        return state.detach().to("cpu", copy=True).contiguous()
    if isinstance(state, dict):
        if _SCALARS.issuperset(map(type, state.values())):  # hyperparameters, counters: nothing to walk
            return dict(state)
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _snapshot(v, old.get(k), into) for k, v in state.items()}
    if type(state) is list and _SCALARS.issuperset(map(type, state)):
        return list(state)
    if isinstance(state, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(state) else [None] * len(state)
        return type(state)(_snapshot(v, o, into) for v, o in zip(state, old))
    return state


def _prefixed(hook: PointHook | None, name: str) -> PointHook | None:
    return None if hook is None else (lambda point: hook(f"{name}:{point}"))


def _point(hook: PointHook | None, name: str) -> None:
    if hook is not None:
        hook(name)
