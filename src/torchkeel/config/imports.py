"""Resolve the user's ``module:callable`` import paths and call them with their ``args``.

Errors name the config key (``model.target``, ``data.args``...) and the fix. Exceptions raised
inside the user's own callable are not wrapped: they are the user's bug and keep their traceback.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torchkeel.errors import ConfigError


def resolve_target(spec: str, key: str) -> Callable[..., Any]:
    """Import ``module:attr`` (``attr`` may be dotted) and return it; ``key`` names the config key."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(f"{key}={spec!r} must be an import path 'module:callable', e.g. 'mypkg.models:build'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}={spec!r}: cannot import module '{module_name}' ({exc}); "
            "check the spelling and that it is installed or in the current directory"
        ) from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{key}={spec!r}: module '{module_name}' has no attribute '{attr_path}'; check the name after the colon"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}={spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def build_target(
    spec: str,
    args: Mapping[str, Any],
    key: str,
    *,
    call_args: tuple[Any, ...] = (),
    call_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """Resolve ``spec`` and call it with ``*call_args, **call_kwargs, **args``.

    The arguments are bound against the signature first, so a misspelt entry of ``<key>.args``
    is reported as a config error rather than a traceback from inside the call.
    """
    fn = check_target(spec, args, key, call_args=call_args, call_kwargs=call_kwargs)
    return fn(*call_args, **{**(call_kwargs or {}), **args})


def check_target(
    spec: str,
    args: Mapping[str, Any],
    key: str,
    *,
    call_args: tuple[Any, ...] = (),
    call_kwargs: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """What ``build_target`` checks before the call: ``spec`` resolves, and ``args`` fit it."""
    fn = resolve_target(spec, f"{key}.target")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # builtins without a signature: let the call report
    _check_names(signature, args, spec, key)
    try:
        signature.bind(*call_args, **{**(call_kwargs or {}), **args})
    except TypeError as exc:
        raise ConfigError(f"{key}.args do not fit {spec}{signature}: {exc}; fix the keys under {key}.args") from None
    return fn


def _check_names(signature: inspect.Signature, args: Mapping[str, Any], spec: str, key: str) -> None:
    """A misspelt argument name is the usual mistake: name it and suggest the closest one."""
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for name in args:
        if name not in params:
            hint = difflib.get_close_matches(name, list(params), n=1)
            suggestion = f"did you mean '{hint[0]}'?" if hint else f"its arguments: {', '.join(params)}"
            raise ConfigError(f"{key}.args.{name} is not an argument of {spec}; {suggestion}")
