"""``model.hf``: a transformers model built from a config, or loaded from a local ``save_pretrained``
directory — nothing is downloaded, and no pickle is read.

The model's own loss is the step (``model(**batch).loss``, see ``train.objective``): a causal LM
shifts its labels itself, and the step counts the labels that are not ignored.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from torchkeel.config.schema import HFModelConfig
from torchkeel.errors import ConfigError, MissingExtraError, first_line

TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
}
"""``model.hf.task`` → the transformers Auto class that picks the head."""

PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")
"""Weight files read with pickle (``pytorch_model.bin``...): refused, as everywhere in torchkeel."""


def build_hf_model(cfg: HFModelConfig) -> torch.nn.Module:
    """The transformers model ``cfg`` describes (weights initialized from the seeded RNG for
    ``config``, read from safetensors for ``path``; in fp32 either way unless ``model.hf.args``
    says ``dtype``: ``train.precision`` decides what the step computes in).

    Raises:
        MissingExtraError: transformers is not installed.
        ConfigError: naming the ``model.hf`` key at fault and the fix.
    """
    auto = _auto_class(cfg)
    if cfg.path is not None:
        directory = _checked_directory(cfg.path)
        args = dict(cfg.args)
        if "dtype" not in args and "torch_dtype" not in args:  # fp32 weights; train.precision does the rest
            args["dtype" if _major(_transformers().__version__) >= 5 else "torch_dtype"] = torch.float32
        try:
            return auto.from_pretrained(
                directory, local_files_only=True, use_safetensors=True, trust_remote_code=False, **args
            )
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"model.hf.path={cfg.path!r} could not be loaded: {first_line(exc)}") from exc
    config = hf_config(cfg.config or {})
    try:
        return auto.from_config(config, **cfg.args)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"model.hf.task={cfg.task!r} does not fit model_type {config.model_type!r}: {first_line(exc)}"
        ) from exc


def hf_config(values: dict[str, Any]) -> Any:
    """A ``PretrainedConfig`` from ``model.hf.config``: ``model_type`` and that model's settings."""
    transformers = _transformers()
    values = dict(values)
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ConfigError("model.hf.config needs model_type (e.g. gpt2, llama, bert) and that model's settings")
    values = {**_special_ids_beyond(transformers, model_type, values), **values}
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except ValueError as exc:
        raise ConfigError(f"model.hf.config.model_type={model_type!r}: {first_line(exc)}") from exc


def _special_ids_beyond(transformers: Any, model_type: str, values: dict[str, Any]) -> dict[str, Any]:
    """``None`` for the special token ids of the model type's defaults that lie past the given
    ``vocab_size`` (GPT-2's 50256 in a model of 257 byte ids): transformers warns of each on
    every load, and the run's tokenizer names its own (an export records them)."""
    vocab = values.get("vocab_size")
    if not isinstance(vocab, int):
        return {}
    try:
        cls = transformers.CONFIG_MAPPING[model_type]
    except (KeyError, AttributeError):
        return {}
    try:
        defaults = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    beyond = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        default = defaults[key].default if key in defaults else None
        if key not in values and isinstance(default, int) and default >= vocab:
            beyond[key] = None
    return beyond


def check_hf_model(cfg: HFModelConfig) -> None:
    """What can be checked before any rank starts: the keys, transformers, the directory."""
    _auto_class(cfg)
    if cfg.path is not None:
        _checked_directory(cfg.path)
    else:
        hf_config(cfg.config or {})


def check_tokens_fit(model: Any, source: Any) -> None:
    """A token source's ids and block length fit the model's input embedding and positions (else
    the first step fails with an index error deep in the model, or a device-side assert on GPU).

    Raises:
        ConfigError: naming the sizes and the keys to change.
    """
    vocab, block = getattr(source, "vocab_size", None), getattr(source, "block_size", None)
    embeddings = getattr(model, "get_input_embeddings", None)
    if vocab is None or not callable(embeddings):
        return
    rows = getattr(embeddings(), "num_embeddings", None)
    if rows is not None and rows < vocab:
        raise ConfigError(
            f"data.tokenizer has {vocab} token ids but the model's input embedding has {rows} rows; "
            f"give the model vocab_size >= {vocab} (model.hf.config.vocab_size)"
        )
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and block is not None and positions < block:
        raise ConfigError(
            f"data.block_size={block} is longer than the model's {positions} positions; lower "
            "data.block_size or raise the model's n_positions / max_position_embeddings"
        )


def _auto_class(cfg: HFModelConfig) -> Any:
    if (cfg.config is None) == (cfg.path is None):
        raise ConfigError(
            "model.hf needs exactly one of config (a transformers config: {model_type: gpt2, ...}) "
            "and path (a directory written by save_pretrained)"
        )
    return getattr(_transformers(), TASKS[cfg.task])


def _checked_directory(path: str) -> Path:
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model.hf.path={path!r} is not a directory written by save_pretrained (no config.json there)"
        )
    pickled = sorted(p.name for pattern in PICKLED for p in directory.glob(pattern))
    if pickled:
        raise ConfigError(
            f"model.hf.path={path!r} holds weights stored with pickle ({', '.join(pickled)}), which torchkeel "
            "does not read; save the model with save_pretrained(dir) (safetensors) and remove them"
        )
    if not any(directory.glob("*.safetensors")):
        raise ConfigError(f"model.hf.path={path!r} has no .safetensors weights; save the model with save_pretrained")
    return directory


def _major(version: str) -> int:
    return int(version.split(".", 1)[0])


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("hf", "transformers", "model.hf") from None
    return transformers
