"""Text generation's requests, parsed: Triton/KServe's generate extension and OpenAI's
``/v1/completions``. Pure functions of a request's body and the model's ``GenerationEngine``
(its tokenizer and positions); every client mistake is a ``ProtocolError`` (a 4xx) naming the
field, in OpenAI's error shape for its route (``openai_error``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from torchkeel.lm.sampling import GenerationError, SamplingParams
from torchkeel.serve.generation import GenerationEngine
from torchkeel.serve.tensors import ProtocolError

V2_PARAMETERS = {"max_tokens": 64, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None, "stop": None}
"""The generate extension's ``parameters`` and their defaults."""
OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "echo",
                 "logprobs", "suffix", "best_of", "presence_penalty", "frequency_penalty", "logit_bias", "user",
                 "stream_options"}  # fmt: skip
MAX_N = 16
MAX_STOPS = 4


def parse_v2_request(body: dict[str, Any], engine: GenerationEngine) -> tuple[list[int], SamplingParams]:
    """A generate request's ``text_input`` as token ids and its ``parameters`` as ``SamplingParams``."""
    unknown = sorted(set(body) - {"text_input", "parameters", "id", "stream"})
    if unknown:
        raise ProtocolError(400, f"unknown fields {unknown}; send text_input and parameters")
    text = text_field(body.get("text_input"), "text_input")
    given = body.get("parameters", {})
    if not isinstance(given, dict):
        raise ProtocolError(400, f"parameters must be an object, got {type(given).__name__}")
    unknown = sorted(set(given) - set(V2_PARAMETERS))
    if unknown:
        raise ProtocolError(400, f"parameters has no {unknown}; it takes {sorted(V2_PARAMETERS)}")
    values = {**V2_PARAMETERS, **given}
    names = {k: f"parameters.{k}" for k in ("temperature", "top_k", "top_p", "seed", "stop")}
    names.update(max_new_tokens="parameters.max_tokens", prompt="text_input")
    prompt = _encode(engine, text)
    max_tokens = given["max_tokens"] if "max_tokens" in given else _room(values["max_tokens"], len(prompt), engine)
    return prompt, _params(values, max_tokens, len(prompt), engine, names)


def parse_openai_request(
    body: dict[str, Any], engine: GenerationEngine
) -> tuple[list[list[int]], SamplingParams, int, dict[str, Any]]:
    """A completions request's prompts as token ids, its sampling, ``n``, and its flags
    (``stream``, ``echo``, ``include_usage``)."""
    unknown = sorted(set(body) - OPENAI_FIELDS)
    if unknown:
        raise _param_error(f"unrecognized request arguments {unknown}", unknown[0])
    for key, allowed in (("logprobs", (None,)), ("suffix", (None,)), ("presence_penalty", (None, 0)),
                         ("frequency_penalty", (None, 0)), ("logit_bias", (None, {}))):  # fmt: skip
        if body.get(key) not in allowed:
            raise _param_error(f"{key} is not supported by this server; leave it out", key)
    n = body.get("n", 1) if body.get("n") is not None else 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise _param_error(f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    if body.get("best_of") not in (None, n):
        raise _param_error("best_of is not supported (other than equal to n); leave it out", "best_of")
    flags = {}
    for key in ("stream", "echo"):
        value = body.get(key, False)
        if value is not None and not isinstance(value, bool):
            raise _param_error(f"{key} must be true or false, got {value!r}", key)
        flags[key] = bool(value)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _param_error("stream_options must be an object", "stream_options")
    flags["include_usage"] = bool(options.get("include_usage"))
    given = _prompt_list(body.get("prompt"))
    prompts = [_prompt_ids(p, engine, where) for p, where in zip(given, _prompt_names(given))]
    values = {k: v for k in ("temperature", "top_p", "seed", "stop") if (v := body.get(k)) is not None}
    settings = {"temperature": 1.0, "top_p": 1.0, **values}
    params = [  # each prompt checked; a default max_tokens is what the longest prompt leaves room for
        _params(
            settings,
            body["max_tokens"] if body.get("max_tokens") is not None else _room(16, max(map(len, prompts)), engine),
            len(ids),
            engine,
            {"max_new_tokens": "max_tokens", "prompt": where},
        )
        for ids, where in zip(prompts, _prompt_names(given))
    ][0]
    return prompts, params, n, flags


def _room(default: int, prompt_tokens: int, engine: GenerationEngine) -> int:
    """A ``max_tokens`` the client did not send: ``default``, or fewer where the model's positions
    end after the prompt (at least 1: a prompt that alone fills them is then refused for its length)."""
    if engine.max_length is None:
        return default
    return max(1, min(default, engine.max_length - prompt_tokens))


def _encode(engine: GenerationEngine, text: str) -> list[int]:
    """The token ids of ``text``, through the tokenizer's batch call where it has one (a
    ``tokenizers`` tokenizer's releases the GIL: a long prompt then holds up no other request)."""
    tokenizer = engine.tokenizer
    batch = getattr(tokenizer, "encode_batch", None)
    return [int(i) for i in (batch([text])[0] if batch is not None else tokenizer.encode(text))]


def _prompt_list(prompt: Any) -> list[Any]:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(i) for i in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return prompt
    raise _param_error("prompt must be a string, a list of strings, or token ids (a list of integers)", "prompt")


def _prompt_names(given: list[Any]) -> list[str]:
    return ["prompt"] if len(given) == 1 else [f"prompt[{i}]" for i in range(len(given))]


def text_field(value: Any, where: str, param: str | None = None) -> str:
    """``value`` if it is text a tokenizer can read, else a 400 naming ``where``: JSON's
    ``"\\ud800"`` escapes decode to a lone surrogate, which no UTF-8 tokenizer takes."""
    if not isinstance(value, str):
        raise _param_error(f"{where} must be a string, got {type(value).__name__}", param or where)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _param_error(
            f"{where} is not valid Unicode: it holds a lone surrogate {value[exc.start]!r} at character "
            f"{exc.start} (a \\ud800-\\udfff escape not part of a pair); send the text's characters as UTF-8",
            param or where,
        ) from None
    return value


def _prompt_ids(prompt: Any, engine: GenerationEngine, where: str) -> list[int]:
    if isinstance(prompt, str):
        return _encode(engine, text_field(prompt, where, "prompt"))
    if isinstance(prompt, list) and all(_is_int(i) for i in prompt):
        vocab = engine.tokenizer.vocab_size
        bad = [i for i in prompt if not 0 <= i < vocab]
        if bad:
            raise _param_error(
                f"{where} holds token id {bad[0]}, outside [0, {vocab - 1}] (the model's vocabulary)", "prompt"
            )
        return list(prompt)
    raise _param_error(f"{where} must be a string or a list of token ids", "prompt")


def _params(
    values: dict[str, Any], max_tokens: Any, prompt_tokens: int, engine: GenerationEngine, names: dict[str, str]
) -> SamplingParams:
    stop = values.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    where = names.get("stop", "stop")
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise _param_error(f"{where} must be a string or a list of at most {MAX_STOPS} strings", "stop")
    for i, text in enumerate(stops):
        if isinstance(text, str):
            text_field(text, where if isinstance(stop, str) else f"{where}[{i}]", "stop")
    params = SamplingParams(
        max_tokens,
        values.get("temperature", 1.0),
        values.get("top_k", 0),
        values.get("top_p", 1.0),
        values.get("seed"),
        tuple(stops),
    )
    try:
        return params.checked(prompt_tokens, engine.max_length, names)
    except GenerationError as exc:
        raise _param_error(str(exc), exc.field) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _param_error(message: str, param: str | None) -> ProtocolError:
    return ProtocolError(400, _sendable(message), param=_sendable(param))


def openai_error(status: int, message: str, param: str | None, code: str | None = None) -> ProtocolError:
    """An error in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``)."""
    message, param = _sendable(message), _sendable(param)
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return ProtocolError(status, message, param=param, body=body)


def _sendable(text: str | None) -> str | None:
    """``text`` as UTF-8 can carry it: a client's field name can hold a lone surrogate (escaped here)."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")
