"""One checkpoint on disk: a directory of safetensors and JSON files, and a manifest written last.

Layout of ``step-00000120/``::

    model.safetensors   the model's state_dict (loadable by any safetensors reader)
    state.safetensors   every other tensor: optimizer moments, RNG states, ...
    state.json          everything else: structure, scalars, counters, python/numpy RNG
    manifest.json       step, epoch, metrics, versions, git commit, config hash, creation
                        time, and the size and sha256 of every file above

A checkpoint is valid only if its manifest is present and every file matches its hash.
Safetensors has no checksum of its own, hence the manifest. Nothing here unpickles.
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

import safetensors.torch
import torch

from torchkeel.checkpoint.codec import decode, encode
from torchkeel.errors import CheckpointError, first_line
from torchkeel.io import fsync_dir, write_bytes_atomic, write_json_atomic

FORMAT_VERSION = 1
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


def write_checkpoint(
    directory: str | Path,
    state: Mapping[str, Any],
    manifest: Mapping[str, Any],
    hook: PointHook | None = None,
) -> Path:
    """Write ``state`` (whose ``"model"`` entry is the model's state_dict) into ``directory``.

    ``state`` must hold CPU tensors that share no storage (``snapshot`` makes such a copy).
    ``manifest`` holds the descriptive fields; file hashes and the format version are added.
    An existing ``directory`` is replaced. The manifest is written last: a kill at any point
    before it leaves a directory that ``read_checkpoint`` rejects.
    """
    target = Path(directory)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    fsync_dir(target.parent)
    model_json, model_tensors = encode(state["model"])
    rest_json, rest_tensors = encode({k: v for k, v in state.items() if k != "model"})
    payloads = {
        MODEL_FILE: safetensors.torch.save(model_tensors),
        STATE_TENSORS: safetensors.torch.save(rest_tensors),
        STATE_JSON: json.dumps({"model": model_json, "state": rest_json}).encode("utf-8"),
    }
    files = {}
    for name, data in payloads.items():
        write_bytes_atomic(target / name, data, _prefixed(hook, name))
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _point(hook, "before_manifest")
    write_json_atomic(
        target / MANIFEST,
        {"format_version": FORMAT_VERSION, **manifest, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "files": files},
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
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint manifest '{path}' is not a torchkeel format {FORMAT_VERSION} manifest")
    files = manifest.get("files")
    if not isinstance(manifest.get("step"), int) or not isinstance(files, dict) or set(files) != {
        MODEL_FILE, STATE_TENSORS, STATE_JSON
    }:
        raise CheckpointError(f"checkpoint manifest '{path}' lacks its step or file list")
    return manifest


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """Verify every file against the manifest, then decode the state.

    Raises:
        CheckpointError: naming the file and the failed check (missing, size, sha256, parse).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint '{directory}' does not exist or is not a directory")
    manifest = read_manifest(directory)
    data = {name: _verified_bytes(directory / name, entry) for name, entry in manifest["files"].items()}
    model_tensors = _load_tensors(directory / MODEL_FILE, data[MODEL_FILE])
    rest_tensors = _load_tensors(directory / STATE_TENSORS, data[STATE_TENSORS])
    try:
        structure = json.loads(data[STATE_JSON])
        state = decode(structure["state"], rest_tensors)
        state["model"] = decode(structure["model"], model_tensors)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint file '{directory / STATE_JSON}' does not match its tensors ({type(exc).__name__}: {exc})"
        ) from None
    return Checkpoint(directory, manifest, state)


def _verified_bytes(path: Path, entry: Any) -> bytes:
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise CheckpointError(f"checkpoint manifest has no hash for '{path}'")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file '{path}' is missing") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file '{path}' is unreadable ({exc.strerror})") from None
    if len(data) != entry.get("bytes"):
        raise CheckpointError(
            f"checkpoint file '{path}' has {len(data)} bytes, the manifest says {entry.get('bytes')} (truncated?)"
        )
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file '{path}' fails its sha256 check (corrupted)")
    return data


def _load_tensors(path: Path, data: bytes) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load(data)
    except Exception as exc:  # noqa: BLE001 - the library raises several types for bad headers
        raise CheckpointError(f"checkpoint file '{path}' is not valid safetensors ({first_line(exc)})") from None


def snapshot(state: Any) -> Any:
    """A copy of ``state`` with every tensor detached, contiguous, on the CPU and unshared.

    Safetensors refuses tensors that share storage (tied weights), and an asynchronous save
    needs a copy the training loop cannot change under it.
    """
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True).contiguous()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return state


def _prefixed(hook: PointHook | None, name: str) -> PointHook | None:
    return None if hook is None else (lambda point: hook(f"{name}:{point}"))


def _point(hook: PointHook | None, name: str) -> None:
    if hook is not None:
        hook(name)
