"""Text in, text out, for a language model's export: Triton/KServe's generate extension
(``/v2/models/{m}/generate`` and ``generate_stream``, server-sent events) and OpenAI's
``/v1/completions`` (streamed with ``stream: true``). Parsing is in ``textparse``; decoding is
the model's ``GenerationEngine``. Every client mistake is a 4xx naming the field."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from torchkeel.lm.sampling import SamplingParams
from torchkeel.serve.generation import GenerationEngine, GenerationRequest
from torchkeel.serve.model import ServedModel
from torchkeel.serve.repository import ModelRepository
from torchkeel.serve.tensors import ProtocolError
from torchkeel.serve.textparse import openai_error, parse_openai_request, parse_v2_request, text_field


class GenerationRoutes:
    """The routes of text generation, served by ``repository``'s language models; ``read_body``
    reads a request's body within the server's bound. Each request is one ``_Generate`` or
    ``_Completion``: submitted to the model's engine, then answered whole or streamed."""

    def __init__(self, repository: ModelRepository, read_body: Callable[[Request], Awaitable[bytes]]) -> None:
        self.repository, self.read_body = repository, read_body

    def routes(self) -> list[Route]:
        return [
            Route("/v2/models/{name}/generate", self.v2_generate, methods=["POST"]),
            Route("/v2/models/{name}/generate_stream", self.v2_generate, methods=["POST"]),
            Route("/v2/models/{name}/versions/{version}/generate", self.v2_generate, methods=["POST"]),
            Route("/v2/models/{name}/versions/{version}/generate_stream", self.v2_generate, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ]

    async def v2_generate(self, request: Request) -> Response:
        """``POST /v2/models/{name}[/versions/{version}]/generate[_stream]``."""
        model = self.repository.get(request.path_params["name"], request.path_params.get("version"))
        call = _Generate(model, request, self.read_body)
        if not request.url.path.endswith("_stream"):
            return await model.counted("generate", call.answer)
        return await _streamed(model, "generate", call.stream)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``, streamed with ``stream: true``."""
        body = await json_body(self.read_body, request)
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise openai_error(400, "model is required: the name of a served model", "model")
        try:
            model = self.repository.get(text_field(name, "model"))
        except ProtocolError as exc:  # a lone surrogate (400), unknown (404), failed to load (503)
            raise openai_error(
                exc.status, str(exc), "model", "model_not_found" if exc.status == 404 else None
            ) from None
        call = _Completion(model, body)
        if body.get("stream") is True:
            return await _streamed(model, "openai", call.stream)
        return await model.counted("openai", call.answer)

    async def chat(self, request: Request) -> Response:
        raise openai_error(
            404,
            "/v1/chat/completions is not served yet; apply the model's chat template (model.json names "
            "its file) to the messages and send the text as prompt to /v1/completions",
            None,
            "not_found",
        )


async def json_body(read_body: Callable[[Request], Awaitable[bytes]], request: Request) -> dict[str, Any]:
    """The request's body, a JSON object, or a 400 saying what it is instead."""
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
    """The model's decoding engine; a 400 for a model that does not generate, a 503 before it is ready."""
    if model.generation is None:
        raise ProtocolError(
            400,
            f"model '{model.name}' is not a language model with a tokenizer (its model.json records "
            "no task causal-lm and tokenizer); use /v2/models/{name}/infer",
        )
    if not model.ready:
        raise ProtocolError(503, f"model '{model.name}' is not ready", {"Retry-After": "1"})
    return model.generation


class _Generate:
    """One request of Triton's generate extension to ``model``: its body read (counted with the
    request) and its prompt submitted, answered whole (``answer``) or as events (``stream``)."""

    def __init__(self, model: ServedModel, request: Request, read_body: Callable[[Request], Awaitable[bytes]]) -> None:
        self.model, self.request, self.read_body = model, request, read_body
        self.head = {"model_name": model.name, "model_version": model.version}

    async def submit(self) -> GenerationRequest:
        engine = engine_of(self.model)
        body = await json_body(self.read_body, self.request)
        prompt, params = await asyncio.to_thread(parse_v2_request, body, engine)  # tokenizing: off the loop
        return engine.submit(prompt, params)

    async def answer(self) -> Response:
        [row] = await (await self.submit()).finished()
        return JSONResponse({**self.head, "text_output": row.text, "finish_reason": row.finish_reason})

    async def stream(self) -> tuple[AsyncIterator[str], list[GenerationRequest]]:
        submitted = await self.submit()
        return _v2_events(self.head, submitted), [submitted]


class _Completion:
    """One ``/v1/completions`` request of ``model``: its prompts parsed and submitted (``n`` rows
    each), answered whole (``answer``) or as events (``stream``)."""

    def __init__(self, model: ServedModel, body: dict[str, Any]) -> None:
        self.model, self.body = model, body

    def parsed(self) -> tuple[GenerationEngine, list[list[int]], SamplingParams, int, dict[str, Any]]:
        try:
            engine = engine_of(self.model)
            prompts, params, n, options = parse_openai_request(self.body, engine)
        except ProtocolError as exc:
            raise openai_error(exc.status, str(exc), exc.param) from None
        options["echo"] = [engine.tokenizer.decode(p) if options["echo"] else "" for p in prompts]
        return engine, prompts, params, n, options

    async def submit(self) -> tuple[list[GenerationRequest], dict[str, Any], dict[str, Any]]:
        # A long prompt takes its tokenizer a while: in a thread, the loop goes on serving others.
        engine, prompts, params, n, options = await asyncio.to_thread(self.parsed)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model.name,
        }
        return [engine.submit(prompt, params, n) for prompt in prompts], head, {**options, "n": n}

    async def answer(self) -> Response:
        requests, head, options = await self.submit()
        choices = []
        for p, submitted in enumerate(requests):
            for row in await submitted.finished():
                text = options["echo"][p] + row.text
                choices.append(
                    {"index": len(choices), "text": text, "logprobs": None, "finish_reason": row.finish_reason}
                )
        return JSONResponse({**head, "choices": choices, "usage": _usage(requests)})

    async def stream(self) -> tuple[AsyncIterator[str], list[GenerationRequest]]:
        requests, head, options = await self.submit()
        return _openai_events(head, requests, options), requests


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
        raise openai_error(exc.status, str(exc), "model", "model_not_found" if exc.status == 404 else None) from None
    return {"name": model.name, "ready": repository.model_ready(model), **_openai_model(model)}


def _openai_model(model: ServedModel) -> dict[str, Any]:
    """OpenAI's model object; ``created`` is when the export was written (its model.json)."""
    try:
        created = int((model.path / "model.json").stat().st_mtime)
    except OSError:  # removed since it was loaded: the model still serves
        created = 0
    return {"id": model.name, "object": "model", "created": created, "owned_by": "torchkeel"}


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
