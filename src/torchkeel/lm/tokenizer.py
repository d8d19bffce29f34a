"""The run's tokenizer beside an export: files transformers loads (``AutoTokenizer``,
``pipeline``), the byte tokenizer included, and the same tokenizer loaded back for generation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from torchkeel.data.sources.tokenizer import (
    TOKENIZER_FILES,
    ByteTokenizer,
    FileTokenizer,
    TokenizerSpec,
    load_tokenizer,
    tokenizer_spec,
)
from torchkeel.errors import MissingExtraError
from torchkeel.io import write_json_atomic

BYTE_EOS = "<|endoftext|>"
"""The byte tokenizer's end-of-text token (id 256) as transformers names it."""

TextTokenizer = ByteTokenizer | FileTokenizer


def byte_tokenizer_object() -> Any:
    """The byte tokenizer as a ``tokenizers.Tokenizer``: byte ``b`` is id ``b`` (through the
    byte-level alphabet, with no merges) and ``<|endoftext|>`` is 256."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise MissingExtraError("hf", "tokenizers", "an export's byte tokenizer") from None
    tokenizer = Tokenizer(models.BPE(vocab={char: byte for byte, char in _byte_alphabet().items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BYTE_EOS, special=True)])
    return tokenizer


def _byte_alphabet() -> dict[int, str]:
    """Byte → the printable character byte-level tokenizers stand it for: printable Latin-1
    bytes stand for themselves, the others for code points from 256 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in alphabet):
        alphabet[b] = chr(256 + n)
    return alphabet


def write_tokenizer(spec: TokenizerSpec, out: Path, max_length: int | None) -> dict[str, Any]:
    """Write the tokenizer of ``spec`` into ``out`` as ``save_pretrained`` would (``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``); returns what ``model.json`` records."""
    tokenizer = load_tokenizer(spec)
    out.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {}
    if spec.path is None:
        byte_tokenizer_object().save(str(out / "tokenizer.json"))
        eos = BYTE_EOS
    else:
        source = Path(spec.path)
        if source.is_dir():
            for name in TOKENIZER_FILES:
                if (source / name).is_file() and name != "tokenizer_config.json":
                    shutil.copyfile(source / name, out / name)
            config = _json(source / "tokenizer_config.json")
        if not (out / "tokenizer.json").is_file():
            tokenizer.tokenizer.save(str(out / "tokenizer.json"))
        eos = tokenizer.tokenizer.id_to_token(tokenizer.eos_id)
    config.update({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos})
    config.setdefault("pad_token", eos)
    if max_length is not None:
        config["model_max_length"] = max_length
    write_json_atomic(out / "tokenizer_config.json", config)
    special = {**_json(out / "special_tokens_map.json"), "eos_token": eos, "pad_token": config["pad_token"]}
    write_json_atomic(out / "special_tokens_map.json", special)
    return {
        "file": "tokenizer.json",
        "kind": "byte" if spec.path is None else "file",
        "eos_token": eos,
        "eos_id": tokenizer.eos_id,
        "vocab_size": tokenizer.vocab_size,
    }


def export_tokenizer(export_dir: str | Path, meta: dict[str, Any]) -> TextTokenizer | None:
    """The tokenizer an export carries (``model.json``'s ``tokenizer``), or ``None``."""
    recorded = meta.get("tokenizer")
    if not recorded:
        return None
    if recorded.get("kind") == "byte":
        return ByteTokenizer()
    return load_tokenizer(TokenizerSpec(str(Path(export_dir) / recorded["file"]), recorded.get("eos_token")))


def given_tokenizer(value: str, key: str = "--tokenizer") -> TextTokenizer:
    """``byte``, a ``save_pretrained`` directory or a ``tokenizer.json``, for a run that has none."""
    return load_tokenizer(tokenizer_spec(value, key), key)


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def run_tokenizer_spec(config: Any) -> TokenizerSpec | None:
    """The tokenizer a run's text was tokenized with (``data.tokenizer`` of ``data.format: text``);
    ``None`` for a run of token ids (its tokenizer is not known)."""
    return tokenizer_spec(config.data.tokenizer) if config.data.format == "text" else None
