"""The HTTP server: routes only. Parsing is in ``protocol``, the models in ``model`` and
``repository``, batching in ``batcher``, metrics in ``metrics``, gRPC in ``grpc``, KServe v1
prediction in ``v1``; what both front ends share in ``server``; the connections (a bound on
the time a request takes to arrive) in ``transport``, the bound on a body's size in ``bodies``,
text generation's routes in ``textgen``. KServe v2 / Triton REST under ``/v2``, KServe v1 under
``/v1``, Prometheus at ``/metrics``. ``create_app`` is the table of routes; ``InferenceAnswers``
answers inference, ``ServerRoutes`` the rest (health, metadata, the models' list, metrics).

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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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
from torchkeel.serve.bodies import RequestBodies, header
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
from torchkeel.serve.textgen import GenerationRoutes, v1_model_card, v1_model_list
from torchkeel.serve.v1 import v1_predict
from torchkeel.serve.warmup import warm_over_socket, warm_requests


def create_app(export_dirs: str | Path | Sequence[str | Path], options: ServeOptions | None = None) -> Starlette:
    """The ASGI application serving the exports in ``export_dirs`` (directories of exports expand
    to the exports in them); with ``options.grpc_port`` it also starts the gRPC service."""
    if isinstance(export_dirs, (str, Path)):
        export_dirs = [export_dirs]
    server = Server(export_dirs, options or ServeOptions())
    bodies = RequestBodies(server.options.max_body_mb)
    answers = InferenceAnswers(server.options, bodies).by_protocol()
    http = ServerRoutes(server, answers)
    text = GenerationRoutes(server.repository, bodies.of_request)
    routes = [  # the inference routes first: Starlette tries them in order on every request
        Route("/v2/models/{name}/infer", http.infer, methods=["POST"]),
        Route("/v1/models/{spec}", http.v1_model, methods=["GET", "POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", http.infer, methods=["POST"]),
        Route("/v2", http.v2_server),
        Route("/v2/health/live", http.live),
        Route("/v2/health/ready", http.ready),
        Route("/v2/repository/index", http.repository_index, methods=["GET", "POST"]),
        Route("/v2/models/{name}", http.model_metadata),
        Route("/v2/models/{name}/versions/{version}", http.model_metadata),
        Route("/v2/models/{name}/ready", http.model_ready),
        Route("/v2/models/{name}/versions/{version}/ready", http.model_ready),
        *text.routes(),
        Route("/v1/models", http.v1_models),
        Route("/metrics", http.metrics),
    ]
    app = Starlette(
        routes=routes,
        lifespan=http.lifespan,
        exception_handlers={404: not_found, 405: not_allowed, ProtocolError: protocol_error},
        middleware=[Middleware(InferenceRoutes, repository=server.repository, answers=answers)],
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


class InferenceAnswers:
    """The answers of the two inference routes, KServe v2's ``infer`` and v1's ``predict``, from
    a request's scope and body: what ``InferenceRoutes`` and the Starlette routes both send."""

    def __init__(self, options: ServeOptions, bodies: RequestBodies) -> None:
        self.options, self.bodies = options, bodies

    def by_protocol(self) -> dict[str, Answerer]:
        return {"v2": self.infer, "v1": self.predict}

    async def infer(self, model: ServedModel, scope: Scope, receive: Receive) -> Answer:
        """``POST /v2/models/{name}[/versions/{version}]/infer``: JSON or binary tensors."""
        opts = self.options
        body = await self.bodies.read(scope, receive)
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

    async def predict(self, model: ServedModel, scope: Scope, receive: Receive) -> Answer:
        """``POST /v1/models/{name}:predict``: KServe v1's instances."""
        body = await self.bodies.read(scope, receive)
        return Answer(200, render_json(await v1_predict(model, body, self.options)))


class ServerRoutes:
    """The server's Starlette routes besides text generation: health, metadata, the repository
    index, KServe v1's model routes, the inference routes' fallback, metrics, and the lifespan
    that starts and stops the models."""

    def __init__(self, server: Server, answers: dict[str, Answerer]) -> None:
        self.server, self.repository, self.answers = server, server.repository, answers

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        server, opts = self.server, self.server.options
        await server.start(warm=functools.partial(warm_requests, app))
        gc.freeze()  # the models and imports never become garbage; full collections then stay short
        warming = None
        if opts.http_port and server.warmed:  # the server listens once this returns: warm over its socket
            self.repository.holding = True
            warming = asyncio.create_task(warm_over_socket(server, opts.http_host, opts.http_port))
        yield
        if warming is not None:
            warming.cancel()
        await server.stop()  # everything already queued is answered first

    async def answered(self, protocol: str, model: ServedModel, request: Request) -> Response:
        answer = await model.counted(protocol, lambda: self.answers[protocol](model, request.scope, request.receive))
        return Response(answer.payload, answer.status, answer.headers, answer.media_type)

    def model_of(self, request: Request) -> ServedModel:
        return self.repository.get(request.path_params["name"], request.path_params.get("version"))

    async def v2_server(self, request: Request) -> Response:
        return JSONResponse({"name": "torchkeel", "version": __version__, "extensions": EXTENSIONS})

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.repository.ready else 503)

    async def model_metadata(self, request: Request) -> Response:
        return JSONResponse(self.model_of(request).metadata())

    async def model_ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.repository.model_ready(self.model_of(request)) else 503)

    async def repository_index(self, request: Request) -> Response:
        return JSONResponse(self.repository.index())

    async def infer(self, request: Request) -> Response:  # InferenceRoutes answers first: the same answer
        return await self.answered("v2", self.model_of(request), request)

    async def v1_models(self, request: Request) -> Response:
        return JSONResponse(v1_model_list(self.repository))  # KServe v1's and OpenAI's list in one body

    async def v1_model(self, request: Request) -> Response:
        name, _, verb = request.path_params["spec"].partition(":")
        if request.method == "GET" and not verb:
            return JSONResponse(v1_model_card(self.repository, name))  # KServe v1's and OpenAI's model
        model = self.repository.get(name)
        if request.method == "POST" and verb == "predict":  # InferenceRoutes answers first: the same answer
            return await self.answered("v1", model, request)
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

    async def metrics(self, request: Request) -> Response:
        return Response(self.server.metrics.render(), media_type="text/plain; version=0.0.4")


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


def render_json(content: Any) -> bytes:
    """JSON as Starlette's ``JSONResponse`` writes it (NaN is refused: a ValueError)."""
    return _JSON.encode(content).encode()


_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # built once, not per call


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
