"""The run's tokenizer beside an export: files transformers loads (``AutoTokenizer``,
``pipeline``, ``apply_chat_template``), the byte tokenizer included, with the special tokens the
model's config names; the same tokenizer loaded back for generation; and ``text_tokenizer``, the
one adapter from the tokenizers users have to what generation needs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchkeel.data.sources.tokenizer import (
    EOS_NAMES,
    TOKENIZER_FILES,
    ByteTokenizer,
    FileTokenizer,
    TokenizerSpec,
    load_tokenizer,
    tokenizer_spec,
)
from torchkeel.errors import ConfigError, MissingExtraError
from torchkeel.io import write_json_atomic

if TYPE_CHECKING:
    from torchkeel.lm.decoding import Tokenizer

BYTE_EOS = "<|endoftext|>"
"""The byte tokenizer's end-of-text token (id 256) as transformers names it."""

TextTokenizer = ByteTokenizer | FileTokenizer

CARRIED_FILES = (*TOKENIZER_FILES, "added_tokens.json", "chat_template.jinja", "chat_template.json")
"""The files of a tokenizer directory an export carries (its chat template included)."""
CHAT_TEMPLATES = "additional_chat_templates"
"""transformers' folder of a tokenizer's further named chat templates."""
SPECIAL_KINDS = ("eos", "bos", "pad")
"""The special tokens a model's config names by id (``eos_token_id``…) and its tokenizer by text."""


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


def write_tokenizer(
    spec: TokenizerSpec,
    out: Path,
    max_length: int | None,
    model_ids: Mapping[str, Any] | None = None,
    where: str = "model.hf.config",
) -> dict[str, Any]:
    """Write the tokenizer of ``spec`` into ``out`` as ``save_pretrained`` would (``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``, the chat template where it has one);
    returns what ``model.json`` records.

    ``model_ids`` are the special token ids the model's config sets (``eos_token_id``,
    ``bos_token_id``, ``pad_token_id``; ``where`` names that config): each is kept, and the
    tokenizer files name its token, so that the model and its tokenizer agree (see
    ``special_tokens``). An id the config does not set is the tokenizer's (its end-of-text for
    a token it names none for).

    Raises:
        ConfigError: the model's config and the tokenizer name different special tokens.
    """
    tokenizer = load_tokenizer(spec)
    vocab = byte_tokenizer_object() if spec.path is None else tokenizer.tokenizer
    source = Path(spec.path) if spec.path is not None and Path(spec.path).is_dir() else None
    config = _json(source / "tokenizer_config.json") if source is not None else {}
    named = {**_json(source / "special_tokens_map.json"), **config} if source is not None else {}
    chosen = special_tokens(tokenizer.eos_id, _token_names(named), model_ids or {}, vocab, where)
    out.mkdir(parents=True, exist_ok=True)
    if source is not None:
        _copy_tokenizer_files(source, out)
    if not (out / "tokenizer.json").is_file():
        vocab.save(str(out / "tokenizer.json"))
    tokens = {f"{kind}_token": token for kind, (token, _) in chosen.items()}
    config.update({"tokenizer_class": "PreTrainedTokenizerFast", **tokens})
    if max_length is not None:
        config["model_max_length"] = max_length
    write_json_atomic(out / "tokenizer_config.json", config)
    write_json_atomic(out / "special_tokens_map.json", {**_json(out / "special_tokens_map.json"), **tokens})
    chat = next((n for n in ("chat_template.jinja", "chat_template.json") if (out / n).is_file()), None)
    return {
        "file": "tokenizer.json",
        "kind": "byte" if spec.path is None else "file",
        **{f"{kind}_{part}": value for kind, pair in chosen.items() for part, value in zip(("token", "id"), pair)},
        "vocab_size": tokenizer.vocab_size,
        **({"chat_template": chat or "tokenizer_config.json"} if chat or "chat_template" in config else {}),
    }


def special_tokens(
    eos_id: int, named: Mapping[str, str], model_ids: Mapping[str, Any], vocab: Any, where: str
) -> dict[str, tuple[str, int]]:
    """The end-of-text, beginning and padding tokens of an export: ``kind → (token, id)``.

    ``eos_id`` is the tokenizer's end-of-text (the one training put between documents),
    ``named`` the ``bos``/``pad`` tokens its config names, ``model_ids`` the ids the model's
    config sets and ``vocab`` a ``tokenizers.Tokenizer`` (``id_to_token``, ``token_to_id``). An id
    the model's config sets is kept (an ``eos_token_id`` list must hold the tokenizer's); one it
    does not set is the tokenizer's, else the end-of-text.

    Raises:
        ConfigError: the model's config and the tokenizer name different tokens, or the config
            names an id the tokenizer does not have.
    """
    chosen = {}
    for kind in SPECIAL_KINDS:
        given = model_ids.get(f"{kind}_token_id")
        own = eos_id if kind == "eos" else vocab.token_to_id(named[kind]) if kind in named else None
        agrees = own is None or given is None or own == given or (isinstance(given, list) and own in given)
        if not agrees:
            raise ConfigError(
                f"{where} sets {kind}_token_id={given!r}, but the tokenizer's {kind} token "
                f"{vocab.id_to_token(own)!r} is id {own}: the export's config and tokenizer would disagree; "
                f"set {kind}_token_id: {own} in {where}, or use a tokenizer whose {kind} token is id {given!r}"
            )
        ident = own if own is not None else given[0] if isinstance(given, list) else given
        ident = eos_id if ident is None else int(ident)
        token = vocab.id_to_token(ident) if ident >= 0 else None  # a negative id is no token (and no u32)
        if token is None:
            raise ConfigError(
                f"{where} sets {kind}_token_id={given!r}, which is not a token of the tokenizer "
                f"({vocab.get_vocab_size(with_added_tokens=True)} ids); set an id of one of its tokens"
            )
        chosen[kind] = (token, ident)
    return chosen


def _token_names(config: Mapping[str, Any]) -> dict[str, str]:
    """``bos``/``pad`` → the token a tokenizer's config names (a string, or ``{content: ...}``)."""
    names = {}
    for kind in ("bos", "pad"):
        value = config.get(f"{kind}_token")
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            names[kind] = value
    return names


def _copy_tokenizer_files(source: Path, out: Path) -> None:
    """The tokenizer files of a ``save_pretrained`` directory (its config is written afresh)."""
    for name in CARRIED_FILES:
        if (source / name).is_file() and name != "tokenizer_config.json":
            shutil.copyfile(source / name, out / name)
    templates = sorted((source / CHAT_TEMPLATES).glob("*.jinja"))
    if templates:  # file by file: copytree would give the folder the source's mode, not the umask's
        (out / CHAT_TEMPLATES).mkdir(exist_ok=True)
        for template in templates:
            shutil.copyfile(template, out / CHAT_TEMPLATES / template.name)


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
    """The tokenizer of a run: the one its text was tokenized with (``data.tokenizer`` of
    ``data.format: text``), else the fast tokenizer (``tokenizer.json``) saved beside the weights
    it fine-tuned (``model.hf.path``); ``None`` for a run of token ids from a model of its own."""
    if config.data.format == "text":
        return tokenizer_spec(config.data.tokenizer)
    hf = getattr(config.model, "hf", None)
    path = Path(hf.path).expanduser() if hf is not None and hf.path is not None else None
    if path is not None and (path / "tokenizer.json").is_file():
        return TokenizerSpec(str(path))
    return None


class _PretrainedTokenizer:
    """A transformers tokenizer (``PreTrainedTokenizer``/``…Fast``, ``AutoTokenizer``'s)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id = _needed_eos(tokenizer.eos_token_id, "its eos_token")
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Seq[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


class _TokenizersObject:
    """A ``tokenizers.Tokenizer``; its end-of-text is the first of ``EOS_NAMES`` it holds."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        found = (tokenizer.token_to_id(name) for name in EOS_NAMES)
        self.eos_id = _needed_eos(next((i for i in found if i is not None), None), f"any of {', '.join(EOS_NAMES)}")
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Seq[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _needed_eos(eos_id: int | None, what: str) -> int:
    if eos_id is None:
        raise ConfigError(f"the tokenizer given to generate names no end-of-text token ({what}); give it one")
    return int(eos_id)


def text_tokenizer(tokenizer: Any) -> Tokenizer:
    """What generation needs (``encode``, ``decode``, ``eos_id``, ``vocab_size``) from the
    tokenizers users have: torchkeel's own (``ByteTokenizer``, ``FileTokenizer``, or any object
    with those four), a transformers tokenizer, or a ``tokenizers.Tokenizer``. A prompt is encoded
    without the tokenizer's added special tokens, as transformers' text-generation pipeline and
    training on text do; the text is decoded without special tokens.

    Raises:
        TypeError: ``tokenizer`` is none of these.
        ConfigError: it names no end-of-text token.
    """
    if all(hasattr(tokenizer, name) for name in ("encode", "decode", "eos_id", "vocab_size")):
        return tokenizer
    if hasattr(tokenizer, "eos_token_id") and callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
        return _PretrainedTokenizer(tokenizer)
    if callable(getattr(tokenizer, "token_to_id", None)) and callable(getattr(tokenizer, "get_vocab_size", None)):
        return _TokenizersObject(tokenizer)
    raise TypeError(
        f"generate takes a torchkeel, transformers or tokenizers tokenizer, got {type(tokenizer).__name__}; "
        "or give an object with encode(text), decode(ids), eos_id and vocab_size"
    )
