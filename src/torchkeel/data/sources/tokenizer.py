"""Tokenizers for ``data.format: text``: UTF-8 bytes, or a ``tokenizers``/transformers tokenizer
saved on disk, described by a ``TokenizerSpec`` that every process (DataLoader workers, the
counting pool) can load it from."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchkeel.errors import ConfigError, MissingExtraError, first_line

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer, in a form every process can load it from: ``path`` is ``None`` for bytes."""

    path: str | None = None
    eos: str | None = None


class ByteTokenizer:
    """UTF-8 bytes as token ids 0–255, the end of a document 256: no vocabulary file needed."""

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Any) -> str:
        """The text of ``ids``: their bytes as UTF-8 (an incomplete character as U+FFFD), the
        end-of-text token left out."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A ``tokenizers`` tokenizer from a ``tokenizer.json`` (a file, or a directory written by
    ``save_pretrained``); a directory without one is loaded through transformers' fast tokenizer."""

    def __init__(self, spec: TokenizerSpec, key: str = "data.tokenizer") -> None:
        assert spec.path is not None
        path = Path(spec.path)
        self.tokenizer = _tokenizers_object(path, key)
        eos = spec.eos or _configured_eos(path) or next((n for n in EOS_NAMES if self._id(n) is not None), None)
        if eos is None:
            raise ConfigError(
                f"{key}.eos: the tokenizer in '{path}' names no end-of-text token; set {key}.eos to one of its tokens"
            )
        eos_id = self._id(eos)
        if eos_id is None:
            raise ConfigError(f"{key}.eos={eos!r} is not a token of the tokenizer in '{path}'; name one of its tokens")
        self.eos_id = eos_id
        self.vocab_size = int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def _id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str) -> np.ndarray:
        # One text at a time: ``encode_batch`` starts the library's thread pool, which a later
        # fork of DataLoader workers would have to switch off (with a warning).
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text, in the library's batch call, which releases the GIL while it
        runs (``encode`` holds it): a server's other threads and event loop go on meanwhile. It
        starts the library's thread pool, so it is for a process that forks no DataLoader
        workers afterwards (a server), not for training."""
        found = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(one.ids, dtype=np.int64) for one in found]

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def tokenizer_spec(value: Any, key: str = "data.tokenizer") -> TokenizerSpec:
    """``byte``, a path (a directory or a ``tokenizer.json``), or ``{path, eos}`` as a spec."""
    if value == "byte":
        return TokenizerSpec()
    if isinstance(value, str):
        value = {"path": value}
    elif not isinstance(value, dict):
        value = {"path": getattr(value, "path", None), "eos": getattr(value, "eos", None)}
    unknown = set(value) - {"path", "eos"}
    if unknown or not value.get("path"):
        raise ConfigError(f"{key} must be 'byte', a tokenizer directory, or {{path, eos}}; got {value!r}")
    path = os.path.expanduser(str(value["path"]))
    if not os.path.exists(path):
        raise ConfigError(
            f"{key}: '{path}' not found; give a directory with tokenizer.json (save_pretrained), "
            "a tokenizer.json file, or 'byte'"
        )
    return TokenizerSpec(path, value.get("eos"))


def load_tokenizer(spec: TokenizerSpec, key: str = "data.tokenizer") -> ByteTokenizer | FileTokenizer:
    return ByteTokenizer() if spec.path is None else FileTokenizer(spec, key)


def _tokenizers_object(path: Path, key: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise MissingExtraError("hf", "tokenizers", f"{key}={str(path)!r}") from None
    file = path if path.is_file() else path / "tokenizer.json"
    if file.is_file():
        try:
            return Tokenizer.from_file(str(file))
        except Exception as exc:
            raise ConfigError(f"{key}: '{file}' is not a tokenizer file: {first_line(exc)}") from exc
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise MissingExtraError("hf", "transformers", f"{key}={str(path)!r} without tokenizer.json") from None
    try:
        loaded = AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True)
    except Exception as exc:
        raise ConfigError(f"{key}: no tokenizer could be loaded from '{path}': {first_line(exc)}") from exc
    if not getattr(loaded, "is_fast", False):
        raise ConfigError(f"{key}: '{path}' holds a slow tokenizer only; save it with a tokenizer.json (a fast one)")
    return loaded.backend_tokenizer


def _configured_eos(path: Path) -> str | None:
    """The end-of-text token a ``save_pretrained`` directory names, if it names one."""
    if not path.is_dir():
        return None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            eos = json.loads((path / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return None


def tokenizer_identity(spec: TokenizerSpec) -> Any:
    """What a block count depends on in the tokenizer: its files' contents."""
    if spec.path is None:
        return "byte"
    path = Path(spec.path)
    files = [path] if path.is_file() else [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return [digest.hexdigest(), spec.eos]
