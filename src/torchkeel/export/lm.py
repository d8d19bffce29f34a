"""A language model to generate from, opened from wherever a user has one: a run directory or a
checkpoint (the trained weights, decoded with their key/value cache), a ``--format hf`` export
(``save_pretrained``), or an ONNX / TorchScript / torch.export export (``model.json``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchkeel.data.sources.tokenizer import TokenizerSpec, load_tokenizer
from torchkeel.errors import ConfigError, MissingExtraError, first_line
from torchkeel.export.export import trained_model
from torchkeel.export.formats import load_exported, read_model_json
from torchkeel.lm.decoding import Decoder, RecomputeDecoder, decoder_for
from torchkeel.lm.tokenizer import TextTokenizer, export_tokenizer, given_tokenizer, run_tokenizer_spec


@dataclass
class LanguageModel:
    """What generating needs: the model (``None`` for an export run by its runtime), a decoder
    and the tokenizer."""

    name: str
    model: Any
    decoder: Decoder
    tokenizer: TextTokenizer


def open_language_model(path: str | Path, tokenizer: str | None = None) -> LanguageModel:
    """The language model at ``path``; ``tokenizer`` (``byte`` or a tokenizer directory) for a
    run or an export that carries none (a run trained on token ids).

    Raises:
        ConfigError: ``path`` holds no model, or the model has no tokenizer and none is given.
    """
    path = Path(path)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return _pretrained(path, tokenizer)
    if (path / "model.json").is_file():
        return _export(path, tokenizer)
    trained = trained_model(path)
    spec = run_tokenizer_spec(trained.config)
    found = given_tokenizer(tokenizer) if tokenizer else load_tokenizer(spec) if spec else None
    return LanguageModel(trained.config.name, trained.model, decoder_for(trained.model), _needed(found, path))


def _export(path: Path, tokenizer: str | None) -> LanguageModel:
    meta = read_model_json(path)
    names = [t["name"] for t in meta["inputs"]]
    if "input_ids" not in names or not set(names) <= {"input_ids", "attention_mask"}:
        raise ConfigError(
            f"the export in '{path}' takes {names}; generating needs a model of input_ids (and attention_mask)"
        )
    run = load_exported(meta["format"], path / meta["file"], names, meta["outputs"][0]["name"])
    found = given_tokenizer(tokenizer) if tokenizer else export_tokenizer(path, meta)
    return LanguageModel(meta["name"], None, RecomputeDecoder(run, names, meta.get("max_length")), _needed(found, path))


def _pretrained(path: Path, tokenizer: str | None) -> LanguageModel:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise MissingExtraError("hf", "transformers", f"generating from '{path}'") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, use_safetensors=True, trust_remote_code=False
        ).eval()
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"'{path}' could not be loaded as a causal LM: {first_line(exc)}") from exc
    found = given_tokenizer(tokenizer) if tokenizer else None
    if found is None and (path / "tokenizer.json").is_file():
        found = load_tokenizer(TokenizerSpec(str(path)))
    return LanguageModel(path.name, model, decoder_for(model), _needed(found, path))


def _needed(tokenizer: TextTokenizer | None, path: Path) -> TextTokenizer:
    if tokenizer is None:
        raise ConfigError(f"'{path}' has no tokenizer (a run trained on token ids); give one with --tokenizer byte|DIR")
    return tokenizer
