"""The HTTP server: routes only. Parsing is in ``protocol``, the models in ``model`` and
``repository``, batching in ``batcher``, metrics in ``metrics``, gRPC in ``grpc``, KServe v1
prediction in ``v1``; what both front ends share in ``server``; the connections (a bound on
the time a request takes to arrive) in ``transport``. KServe v2 / Triton REST under ``/v2``,
KServe v1 under ``/v1``, Prometheus at ``/metrics``.

The two inference routes, ``POST /v2/models/{name}[/versions/{version}]/infer`` and ``POST
/v1/models/{name}:predict``, are the whole request path of a client under load: they are
answered by ``InferenceRoutes`` ahead of Starlette's router and middleware (a split of the
path, then the model), which is most of what a request costs besides the model. Every other
request, and those paths with another method, go through the Starlette routes below.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from torchkeel._version import __version__
from torchkeel.errors import ConfigError
from torchkeel.serve.model import ServedModel, ServeOptions
from torchkeel.serve.protocol import (
    EXTENSIONS,
    HEADER_LENGTH,
    encode_infer,
    parse_infer,
)
from torchkeel.serve.repository import ModelRepository
from torchkeel.serve.server import Server
from torchkeel.serve.tensors import ProtocolError
from torchkeel.serve.textgen import generation_routes, v1_model_card, v1_model_list
from torchkeel.serve.v1 import v1_predict
from torchkeel.serve.warmup import warm_over_socket, warm_requests

# An oversized body is read to its end and dropped, up to 4x the limit (at least 64 MiB) or 5 s,
# before the 413 is sent and the connection closed; past that bound the connection is closed at once.
DRAIN_FACTOR, DRAIN_MIN_BYTES, DRAIN_S = 4, 64 * 2**20, 5.0


def create_app(export_dirs: str | Path | Sequence[str | Path], options: ServeOptions | None = None) -> Starlette:
    """The ASGI application serving the exports in ``export_dirs`` (directories of exports expand
    to the exports in them); with ``options.grpc_port`` it also starts the gRPC service."""
    if isinstance(export_dirs, (str, Path)):
        export_dirs = [export_dirs]
    server = Server(export_dirs, options or ServeOptions())
    repository = server.repository
    opts = server.options
    max_body = int(opts.max_body_mb * 2**20)
    max_drain = max(DRAIN_FACTOR * max_body, DRAIN_MIN_BYTES)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await server.start(warm=functools.partial(warm_requests, app))
        gc.freeze()  # the models and imports never become garbage; full collections then stay short
        warming = None
        if opts.http_port and server.warmed:  # the server listens once this returns: warm over its socket
            repository.holding = True
            warming = asyncio.create_task(warm_over_socket(server, opts.http_host, opts.http_port))
        yield
        if warming is not None:
            warming.cancel()
        await server.stop()  # everything already queued is answered first

    async def body_of(scope: Scope, receive: Receive) -> bytes:
        """The body, or a 413 the client can read: what is left of an oversized body is read and
        dropped first (see ``_drain``), so that closing the connection does not reset it."""
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            if int(declared) <= max_drain:
                await _drain(receive, int(declared))
            raise _too_large(f"the body has {declared} bytes")
        chunks, size = [], 0
        while True:  # a chunked body declares no length: count it
            message = await receive()
            if message["type"] == "http.disconnect":  # gone, or cut off by the transport's read timeout
                raise ProtocolError(400, "the client closed the connection before the whole body arrived")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_body:
                await _drain(receive, max_drain - size)
                raise _too_large(f"the body has more than {max_body} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read_body(request: Request) -> bytes:
        return await body_of(request.scope, request.receive)

    def _too_large(what: str) -> ProtocolError:
        return ProtocolError(413, f"{what}; the limit is {max_body} bytes (--max-body-mb)", {"Connection": "close"})

    async def infer_answer(model: ServedModel, scope: Scope, receive: Receive) -> Answer:
        body = await body_of(scope, receive)
        parsed = parse_infer(
            body,
            header(scope, HEADER_LENGTH_KEY),
            model.inputs,
            model.outputs,
            opts.max_batch_size,
            opts.allow_nonfinite,
            one_of=model.is_image_model,
        )
        results = await model.infer(parsed)
        payload, headers = encode_infer(model.name, model.version, parsed, results)
        return Answer(200, payload, "application/octet-stream" if headers else "application/json", headers)

    async def predict_answer(model: ServedModel, scope: Scope, receive: Receive) -> Answer:
        return Answer(200, render_json(await v1_predict(model, await body_of(scope, receive), opts)))

    answers = {"v2": infer_answer, "v1": predict_answer}

    async def answered(protocol: str, model: ServedModel, request: Request) -> Response:
        answer = await model.counted(protocol, lambda: answers[protocol](model, request.scope, request.receive))
        return Response(answer.payload, answer.status, answer.headers, answer.media_type)

    def model_of(request: Request) -> ServedModel:
        return repository.get(request.path_params["name"], request.path_params.get("version"))

    async def v2_server(request: Request) -> Response:
        return JSONResponse({"name": "torchkeel", "version": __version__, "extensions": EXTENSIONS})

    async def live(request: Request) -> Response:
        return Response(status_code=200)

    async def ready(request: Request) -> Response:
        return Response(status_code=200 if repository.ready else 503)

    async def model_metadata(request: Request) -> Response:
        return JSONResponse(model_of(request).metadata())

    async def model_ready(request: Request) -> Response:
        return Response(status_code=200 if repository.model_ready(model_of(request)) else 503)

    async def repository_index(request: Request) -> Response:
        return JSONResponse(repository.index())

    async def infer(request: Request) -> Response:  # InferenceRoutes answers first: the same answer
        return await answered("v2", model_of(request), request)

    async def v1_models(request: Request) -> Response:
        return JSONResponse(v1_model_list(repository))  # KServe v1's and OpenAI's list in one body

    async def v1_model(request: Request) -> Response:
        name, _, verb = request.path_params["spec"].partition(":")
        if request.method == "GET" and not verb:
            return JSONResponse(v1_model_card(repository, name))  # KServe v1's and OpenAI's model
        model = repository.get(name)
        if request.method == "POST" and verb == "predict":  # InferenceRoutes answers first: the same answer
            return await answered("v1", model, request)
        if verb == "predict":
            return error(
                405,
                f"{request.method} is not allowed on /v1/models/{name}:predict; POST the instances",
                {"Allow": "POST"},
            )
        return error(
            404,
            f"no route {request.method} /v1/models/{request.path_params['spec']}; use GET "
            f"/v1/models/{model.name} or POST /v1/models/{model.name}:predict",
        )

    async def metrics(request: Request) -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    routes = [  # the inference routes first: Starlette tries them in order on every request
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
        Route("/v1/models/{spec}", v1_model, methods=["GET", "POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"]),
        Route("/v2", v2_server),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2/repository/index", repository_index, methods=["GET", "POST"]),
        Route("/v2/models/{name}", model_metadata),
        Route("/v2/models/{name}/versions/{version}", model_metadata),
        Route("/v2/models/{name}/ready", model_ready),
        Route("/v2/models/{name}/versions/{version}/ready", model_ready),
        *generation_routes(repository, read_body),
        Route("/v1/models", v1_models),
        Route("/metrics", metrics),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_allowed, ProtocolError: protocol_error},
        middleware=[Middleware(InferenceRoutes, repository=repository, answers=answers)],
    )
    app.state.server = server
    return app


HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode()


class Answer(NamedTuple):
    """An inference route's response: status, body, media type, extra headers."""

    status: int
    payload: bytes
    media_type: str = "application/json"
    headers: dict[str, str] | None = None


Answerer = Callable[[ServedModel, Scope, Receive], Awaitable[Answer]]


class InferenceRoutes:
    """ASGI middleware: ``POST`` to the inference routes is answered here, ahead of Starlette's
    router and middleware; anything else goes on to ``app``. ``answers[protocol](model, scope,
    receive)`` makes the answer, counted by the model as the Starlette routes count it."""

    def __init__(self, app: ASGIApp, repository: ModelRepository, answers: dict[str, Answerer]) -> None:
        self.app, self.repository, self.answers = app, repository, answers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = inference_route(route_path(scope)) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            return await self.app(scope, receive, send)
        protocol, name, version = route
        try:
            model = self.repository.get(name, version)
            answer = await model.counted(protocol, lambda: self.answers[protocol](model, scope, receive))
        except ProtocolError as exc:
            answer = Answer(
                exc.status, render_json(exc.body if exc.body is not None else {"error": str(exc)}), headers=exc.headers
            )
        headers = [
            (b"content-length", str(len(answer.payload)).encode()),
            (b"content-type", answer.media_type.encode()),
        ]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (answer.headers or {}).items()]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.payload})


def inference_route(path: str) -> tuple[str, str, str | None] | None:
    """``("v2" | "v1", model name, version or None)`` for a path of an inference route, else ``None``."""
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        parts = path[11:-6].split("/")
        if len(parts) == 1 and parts[0]:
            return "v2", parts[0], None
        if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
            return "v2", parts[0], parts[2]
    elif path.startswith("/v1/models/") and path.endswith(":predict") and len(path) > 19:
        name = path[11:-8]
        if "/" not in name:
            return "v1", name, None
    return None


def route_path(scope: Scope) -> str:
    """The path the routes see: the request's, less the ``root_path`` the app is mounted under."""
    path, root = scope["path"], scope.get("root_path")
    return path[len(root) :] if root and path.startswith(root) else path


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of the request header ``name`` (lower case), or ``None``."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def render_json(content: Any) -> bytes:
    """JSON as Starlette's ``JSONResponse`` writes it (NaN is refused: a ValueError)."""
    return _JSON.encode(content).encode()


_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # built once, not per call


async def _drain(receive: Receive, limit_bytes: int, timeout_s: float = DRAIN_S) -> None:
    """Read and drop the rest of a request body: up to ``limit_bytes``, for at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    with contextlib.suppress(asyncio.TimeoutError):
        while limit_bytes > 0:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
            limit_bytes -= len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                return


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def protocol_error(request: Request, exc: Exception) -> Response:
    """Every route's client mistakes (``ProtocolError``): its status, message and headers."""
    assert isinstance(exc, ProtocolError)
    if exc.body is not None:
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)
    return error(exc.status, str(exc), exc.headers)


async def not_found(request: Request, exc: Exception) -> Response:
    return error(404, f"no route {request.method} {request.url.path}")


async def not_allowed(request: Request, exc: Exception) -> Response:
    return error(405, f"{request.method} is not allowed on {request.url.path}")


@contextlib.contextmanager
def serve_in_background(export_dirs: str | Path | Sequence[str | Path], options: ServeOptions | None = None):
    """Serve on 127.0.0.1 at a free port from a background thread; yields the base URL.

    For demos and notebooks: the server stops (after answering what is queued) when the block ends.
    """
    import socket
    import threading

    import uvicorn

    from torchkeel.serve.transport import bounded_read_protocol

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options = options or ServeOptions()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(export_dirs, options),
            host="127.0.0.1",
            port=port,
            http=bounded_read_protocol(options.read_timeout_s),
            log_level="warning",
            access_log=False,
        )
    )
    thread = threading.Thread(target=server.run, name="torchkeel-serve", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server stopped while starting")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class _Terminated(Exception):
    """SIGTERM, raised again by uvicorn after its graceful shutdown."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated


def serve(
    export_dirs: str | Path | Sequence[str | Path],
    host: str = "127.0.0.1",
    port: int = 8000,
    options: ServeOptions | None = None,
    on_start: Callable[[ModelRepository], None] | None = None,
) -> None:
    """Run the server until SIGTERM/SIGINT; queued requests are answered before it returns.

    uvicorn stops accepting on SIGTERM, lets the requests in flight finish (they wait for the
    batcher, which drains its queue at shutdown), then raises the signal again so that the
    process ends as the signal would have it. That re-raised SIGTERM lands in the handler
    installed here and ends ``serve`` normally: a graceful stop exits 0. gRPC (on
    ``options.grpc_port``, same ``host``) stops with it, after finishing its calls. ``on_start``
    is given the loaded models (and those that failed to load) before the server listens.

    Raises:
        ConfigError: no model could be loaded, or a port is taken.
    """
    import signal

    import uvicorn

    from torchkeel.serve.transport import bounded_read_protocol

    options = dataclasses.replace(options or ServeOptions(), grpc_host=host, http_host=host, http_port=port)
    protocol = bounded_read_protocol(options.read_timeout_s)  # a bad bound is an error before anything starts
    for flag, number in (("--port", port), ("--grpc-port", options.grpc_port)):
        if number:
            _check_free(host, number, flag)
    app = create_app(export_dirs, options)
    if on_start is not None:
        on_start(app.state.server.repository)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        uvicorn.run(app, host=host, port=port, http=protocol, log_level="warning", access_log=False)
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_free(host: str, port: int, flag: str) -> None:
    """A clear error before start-up instead of a bind failure in the middle of it."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise ConfigError(
            f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror}); choose another port"
        ) from None
