"""Text in, text out, for a language model's export: Triton/KServe's generate extension
(``/v2/models/{m}/generate`` and ``generate_stream``, server-sent events) and OpenAI's
``/v1/completions`` (streamed with ``stream: true``). Parsing is here; decoding is the model's
``GenerationEngine``. Every client mistake is a 4xx naming the field."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from torchkeel.lm.sampling import GenerationError, SamplingParams
from torchkeel.serve.generation import GenerationEngine, GenerationRequest
from torchkeel.serve.model import ServedModel
from torchkeel.serve.repository import ModelRepository
from torchkeel.serve.tensors import ProtocolError

V2_PARAMETERS = {"max_tokens": 64, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None, "stop": None}
"""The generate extension's ``parameters`` and their defaults."""
OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "echo",
                 "logprobs", "suffix", "best_of", "presence_penalty", "frequency_penalty", "logit_bias", "user",
                 "stream_options"}  # fmt: skip
MAX_N = 16
MAX_STOPS = 4


def generation_routes(repository: ModelRepository, read_body: Callable[[Request], Awaitable[bytes]]) -> list[Route]:
    """The routes of text generation, served by ``repository``'s language models."""

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await read_body(request)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(400, f"the body is not JSON ({exc}); send a JSON object") from None
        except RecursionError:
            raise ProtocolError(400, "the body is nested too deeply; send a JSON object of the fields") from None
        if not isinstance(body, dict):
            raise ProtocolError(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    def engine_of(model: ServedModel) -> GenerationEngine:
        if model.generation is None:
            raise ProtocolError(
                400,
                f"model '{model.name}' is not a language model with a tokenizer (its model.json records "
                "no task causal-lm and tokenizer); use /v2/models/{name}/infer",
            )
        if not model.ready:
            raise ProtocolError(503, f"model '{model.name}' is not ready", {"Retry-After": "1"})
        return model.generation

    async def v2_generate(request: Request) -> Response:
        model = repository.get(request.path_params["name"], request.path_params.get("version"))
        head = {"model_name": model.name, "model_version": model.version}

        async def submit() -> GenerationRequest:
            engine = engine_of(model)
            body = await body_of(request)
            prompt, params = await asyncio.to_thread(_v2_request, body, engine)  # tokenizing: off the loop
            return engine.submit(prompt, params)

        async def answer() -> Response:
            [row] = await (await submit()).finished()
            return JSONResponse({**head, "text_output": row.text, "finish_reason": row.finish_reason})

        async def stream() -> tuple[AsyncIterator[str], list[GenerationRequest]]:
            submitted = await submit()
            return _v2_events(head, submitted), [submitted]

        if not request.url.path.endswith("_stream"):
            return await model.counted("generate", answer)
        return await _streamed(model, "generate", stream)

    async def completions(request: Request) -> Response:
        body = await body_of(request)
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise _openai_error(400, "model is required: the name of a served model", "model")
        try:
            model = repository.get(_text(name, "model"))
        except ProtocolError as exc:  # a lone surrogate (400), unknown (404), failed to load (503)
            raise _openai_error(
                exc.status, str(exc), "model", "model_not_found" if exc.status == 404 else None
            ) from None

        def parsed() -> tuple[GenerationEngine, list[list[int]], SamplingParams, int, dict[str, Any]]:
            try:
                engine = engine_of(model)
                prompts, params, n, options = _openai_request(body, engine)
            except ProtocolError as exc:
                raise _openai_error(exc.status, str(exc), exc.param) from None
            options["echo"] = [engine.tokenizer.decode(p) if options["echo"] else "" for p in prompts]
            return engine, prompts, params, n, options

        async def submit() -> tuple[list[GenerationRequest], dict[str, Any], dict[str, Any]]:
            # A long prompt takes its tokenizer a while: in a thread, the loop goes on serving others.
            engine, prompts, params, n, options = await asyncio.to_thread(parsed)
            head = {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model.name,
            }
            return [engine.submit(prompt, params, n) for prompt in prompts], head, {**options, "n": n}

        async def answer() -> Response:
            requests, head, options = await submit()
            choices = []
            for p, submitted in enumerate(requests):
                for row in await submitted.finished():
                    text = options["echo"][p] + row.text
                    choices.append(
                        {"index": len(choices), "text": text, "logprobs": None, "finish_reason": row.finish_reason}
                    )
            return JSONResponse({**head, "choices": choices, "usage": _usage(requests)})

        async def stream() -> tuple[AsyncIterator[str], list[GenerationRequest]]:
            requests, head, options = await submit()
            return _openai_events(head, requests, options), requests

        if body.get("stream") is True:
            return await _streamed(model, "openai", stream)
        return await model.counted("openai", answer)

    async def chat(request: Request) -> Response:
        raise _openai_error(
            404,
            "/v1/chat/completions is not served yet; apply the model's chat template (model.json names "
            "its file) to the messages and send the text as prompt to /v1/completions",
            None,
            "not_found",
        )

    return [
        Route("/v2/models/{name}/generate", v2_generate, methods=["POST"]),
        Route("/v2/models/{name}/generate_stream", v2_generate, methods=["POST"]),
        Route("/v2/models/{name}/versions/{version}/generate", v2_generate, methods=["POST"]),
        Route("/v2/models/{name}/versions/{version}/generate_stream", v2_generate, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]


def v1_model_list(repository: ModelRepository) -> dict[str, Any]:
    """``GET /v1/models``: KServe v1's ``{"models": [names]}`` and OpenAI's ``{"object": "list",
    "data": [model, ...]}`` in one body, so that either client reads it."""
    models = [repository.models[name] for name in sorted(repository.models)]
    return {"models": [m.name for m in models], "object": "list", "data": [_openai_model(m) for m in models]}


def v1_model_card(repository: ModelRepository, name: str) -> dict[str, Any]:
    """``GET /v1/models/{name}``: KServe v1's ``{"name", "ready"}`` and OpenAI's model object
    (``id``, ``object``, ``created``, ``owned_by``); an unknown or unavailable model is a
    ``ProtocolError`` (404 or 503) in OpenAI's error shape."""
    try:
        model = repository.get(name)
    except ProtocolError as exc:
        raise _openai_error(exc.status, str(exc), "model", "model_not_found" if exc.status == 404 else None) from None
    return {"name": model.name, "ready": repository.model_ready(model), **_openai_model(model)}


def _openai_model(model: ServedModel) -> dict[str, Any]:
    """OpenAI's model object; ``created`` is when the export was written (its model.json)."""
    try:
        created = int((model.path / "model.json").stat().st_mtime)
    except OSError:  # removed since it was loaded: the model still serves
        created = 0
    return {"id": model.name, "object": "model", "created": created, "owned_by": "torchkeel"}


def _v2_request(body: dict[str, Any], engine: GenerationEngine) -> tuple[list[int], SamplingParams]:
    unknown = sorted(set(body) - {"text_input", "parameters", "id", "stream"})
    if unknown:
        raise ProtocolError(400, f"unknown fields {unknown}; send text_input and parameters")
    text = _text(body.get("text_input"), "text_input")
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


def _openai_request(
    body: dict[str, Any], engine: GenerationEngine
) -> tuple[list[list[int]], SamplingParams, int, dict[str, Any]]:
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


def _text(value: Any, where: str, param: str | None = None) -> str:
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
        return _encode(engine, _text(prompt, where, "prompt"))
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
            _text(text, where if isinstance(stop, str) else f"{where}[{i}]", "stop")
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


def _openai_error(status: int, message: str, param: str | None, code: str | None = None) -> ProtocolError:
    """An error in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``)."""
    message, param = _sendable(message), _sendable(param)
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return ProtocolError(status, message, param=param, body=body)


def _sendable(text: str | None) -> str | None:
    """``text`` as UTF-8 can carry it: a client's field name can hold a lone surrogate (escaped here)."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _usage(requests: list[GenerationRequest]) -> dict[str, int]:
    prompt = sum(r.prompt_tokens for r in requests)
    completion = sum(r.completion_tokens for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _failures_as_messages(request: GenerationRequest) -> AsyncIterator[Any]:
    """The request's updates; the model's failure mid-stream as its message (the status is sent)."""
    try:
        async for updates in request.updates():
            yield updates
    except Exception as exc:  # noqa: BLE001 - the headers are gone: the error travels as an event
        yield f"model execution failed: {type(exc).__name__}: {exc}"


async def _streamed(
    model: ServedModel,
    protocol: str,
    start: Callable[[], Awaitable[tuple[AsyncIterator[str], list[GenerationRequest]]]],
) -> StreamingResponse:
    """Server-sent events of the requests ``start`` submits, counted in the metrics when the
    stream ends (``model.counted`` would count it when the headers go): answered, failed mid-way
    (``BACKEND``), or left by its client (``CANCELED``); the requests of a stream its client left
    are abandoned, and leave the engine's batch at its next step. A mistake in the request is
    raised before the stream starts (a 4xx, ``OTHER``)."""
    metrics, began = model.metrics, time.perf_counter()  # the warm-up's scratch metrics while it lasts
    metrics.request_started()
    try:
        events, requests = await start()
    except BaseException as exc:
        metrics.request_done(protocol, time.perf_counter() - began, _failure(exc))
        if isinstance(exc, Exception) and not isinstance(exc, ProtocolError):
            raise ProtocolError(500, f"model execution failed: {type(exc).__name__}: {exc}") from None
        raise

    async def watched() -> AsyncIterator[str]:
        failure: str | None = "CANCELED"  # unless the events run to their end
        try:
            async for event in events:
                yield event
            failure = "BACKEND" if any(r.error is not None for r in requests) else None
        finally:
            for request in requests:
                request.abandoned = True
            metrics.request_done(protocol, time.perf_counter() - began, failure)

    return StreamingResponse(watched(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _failure(exc: BaseException) -> str:
    """Triton's failure reason for a request that failed before its stream started."""
    if isinstance(exc, ProtocolError):
        return "OTHER"
    return "CANCELED" if isinstance(exc, asyncio.CancelledError) else "BACKEND"


async def _v2_events(head: dict[str, Any], submitted: GenerationRequest) -> AsyncIterator[str]:
    async for updates in _failures_as_messages(submitted):
        if isinstance(updates, str):
            yield _sse({"error": updates})
            return
        for u in updates:
            if u.text or u.finish_reason:
                yield _sse({**head, "text_output": u.text, "finish_reason": u.finish_reason})


async def _openai_events(
    head: dict[str, Any], requests: list[GenerationRequest], options: dict[str, Any]
) -> AsyncIterator[str]:
    n = options["n"]
    for p, submitted in enumerate(requests):
        if options["echo"][p]:
            for r in range(n):
                yield _sse({**head, "choices": [_choice(p * n + r, options["echo"][p], None)]})
        async for updates in _failures_as_messages(submitted):
            if isinstance(updates, str):
                yield _sse({"error": {"message": updates, "type": "server_error", "param": None, "code": None}})
                return
            for u in updates:
                if u.text or u.finish_reason:
                    yield _sse({**head, "choices": [_choice(p * n + u.index, u.text, u.finish_reason)]})
    if options["include_usage"]:
        yield _sse({**head, "choices": [], "usage": _usage(requests)})
    yield "data: [DONE]\n\n"
