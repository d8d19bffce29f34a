"""Load a ``KeelConfig`` from YAML plus dotted ``key=value`` overrides, strictly.

Unknown keys are errors with a did-you-mean; values are checked against the dataclass types.
PyYAML reads ``3e-4`` as a string, so strings that parse as numbers are accepted for float keys.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from torchkeel.config.schema import KeelConfig
from torchkeel.errors import ConfigError


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
) -> KeelConfig:
    """Build a validated config from ``base`` (a dict), then the YAML file, then the overrides.

    Example: ``load_config("cfg.yaml", ["optim.lr=3e-4", "train.accumulate=4"])``.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or invalid value.
    """
    raw: dict[str, Any] = _deep_copy(base or {})
    if path is not None:
        _deep_merge(raw, read_yaml(path))
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    return from_dict(KeelConfig, raw).validate()


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file, a syntax error or a non-mapping is a ``ConfigError``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' not found; pass the path of a YAML file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"config file '{p}'{where}: invalid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of keys, not {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``a.b=value``; the value is parsed as YAML (``true``, ``3``, ``[1, 2]``, ``null``)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override '{item}' must look like key=value, e.g. optim.lr=3e-4")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain data under its YAML key names (for ``config.yaml`` and hashing)."""
    result = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            result[_key(f)] = to_dict(value)
        elif isinstance(value, list) and any(dataclasses.is_dataclass(v) for v in value):
            result[_key(f)] = [to_dict(v) for v in value]
        else:
            result[_key(f)] = copy.deepcopy(value)
    return result


def config_hash(config: Any) -> str:
    """sha256 of the config's canonical JSON (a ``KeelConfig``, or one as plain data): equal configs, equal hashes."""
    text = json.dumps(
        config if isinstance(config, Mapping) else to_dict(config), sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _key(f: dataclasses.Field) -> str:
    """The YAML key of a field (``async`` is a Python keyword, so its field is ``async_save``)."""
    return f.metadata.get("key", f.name)


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, checking every key and type; errors name the key."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'} must be a mapping of keys, got {_describe(data)}")
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    if True in data and "on" in fields:  # YAML 1.1 reads a bare `on:` key as the boolean true
        data = {("on" if key is True else key): value for key, value in data.items()}
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key_message(_join(prefix, str(key)), str(key), list(fields)))
    values = {fields[k].name: _convert(hints[fields[k].name], v, _join(prefix, k)) for k, v in data.items()}
    return cls(**values)


def _convert(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        if isinstance(value, bool) and "enabled" in {f.name for f in dataclasses.fields(tp)}:
            value = {"enabled": value}  # `compile: true` is short for `compile: {enabled: true}`
        return from_dict(tp, value, key)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        if len(inner) == 1:  # Optional[X]: X's own error, which names the inner key at fault
            return _convert(inner[0], value, key)
        errors = []
        for option in inner:
            try:
                return _convert(option, value, key)
            except ConfigError as exc:
                errors.append(str(exc).split(" must be ", 1)[-1].split(", got ")[0])
        raise ConfigError(f"{key} must be {' or '.join(errors)}, got {_describe(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            names = ", ".join(map(str, choices))
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else ""
            raise ConfigError(f"{key} must be one of {names}, got {value!r}{extra}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {_describe(value)}")
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping of keyword arguments, got {_describe(value)}")
        return dict(value)
    if tp in _EXACT:
        expected, is_valid = _EXACT[tp]
        if not is_valid(value):
            raise ConfigError(f"{key} must be {expected}, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {_describe(value)}")
        return float(value)
    raise TypeError(f"config type {tp!r} of {key} is not supported")  # a bug in the schema


# Types taken as they are: what a person reads in the error, and the check.
_EXACT: dict[type, tuple[str, Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _unknown_key_message(full_key: str, key: str, known: list[str]) -> str:
    hint = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if hint:
        return f"unknown config key '{full_key}'; did you mean '{full_key[: -len(key)]}{hint[0]}'?"
    return f"unknown config key '{full_key}'; known keys here: {', '.join(known)}"


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"override '{key}': '{where}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _deep_merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = _deep_copy(value) if isinstance(value, Mapping) else value


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
