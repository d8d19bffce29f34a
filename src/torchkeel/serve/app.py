"""The HTTP server: routes only. Parsing is in ``protocol``, the models in ``model`` and
``repository``, batching in ``batcher``, metrics in ``metrics``, gRPC in ``grpc``, KServe v1
prediction in ``v1``; what both front ends share in ``server``. KServe v2 /
Triton REST under ``/v2``, KServe v1 under ``/v1``, Prometheus at ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

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
from torchkeel.serve.textgen import generation_routes
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

    async def read_body(request: Request) -> bytes:
        """The body, or a 413 the client can read: what is left of an oversized body is read and
        dropped first (see ``_drain``), so that closing the connection does not reset it."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            if int(declared) <= max_drain:
                await _drain(request.stream(), int(declared))
            raise _too_large(f"the body has {declared} bytes")
        stream = request.stream()
        chunks, size = [], 0
        async for chunk in stream:  # a chunked body declares no length: count it
            size += len(chunk)
            if size > max_body:
                await _drain(stream, max_drain - size)
                raise _too_large(f"the body has more than {max_body} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(what: str) -> ProtocolError:
        return ProtocolError(413, f"{what}; the limit is {max_body} bytes (--max-body-mb)", {"Connection": "close"})

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

    async def infer(request: Request) -> Response:
        model = model_of(request)

        async def handle() -> Response:
            body = await read_body(request)
            parsed = parse_infer(
                body,
                request.headers.get(HEADER_LENGTH),
                model.inputs,
                model.outputs,
                opts.max_batch_size,
                opts.allow_nonfinite,
                one_of=model.is_image_model,
            )
            results = await model.infer(parsed)
            payload, headers = encode_infer(model.name, model.version, parsed, results)
            media = "application/octet-stream" if headers else "application/json"
            return Response(payload, media_type=media, headers=headers)

        return await model.counted("v2", handle)

    async def v1_models(request: Request) -> Response:
        return JSONResponse({"models": sorted(repository.models)})

    async def v1_model(request: Request) -> Response:
        name, _, verb = request.path_params["spec"].partition(":")
        model = repository.get(name)
        if request.method == "GET" and not verb:
            return JSONResponse({"name": model.name, "ready": repository.model_ready(model)})
        if request.method == "POST" and verb == "predict":

            async def handle() -> Response:
                return JSONResponse(await v1_predict(model, await read_body(request), opts))

            return await model.counted("v1", handle)
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
    )
    app.state.server = server
    return app


async def _drain(stream: AsyncIterator[bytes], limit_bytes: int, timeout_s: float = DRAIN_S) -> None:
    """Read and drop the rest of a request body: up to ``limit_bytes``, for at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    with contextlib.suppress(asyncio.TimeoutError, ClientDisconnect, StopAsyncIteration):
        while limit_bytes > 0:
            limit_bytes -= len(await asyncio.wait_for(anext(stream), deadline - loop.time()))


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

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(export_dirs, options), host="127.0.0.1", port=port, log_level="warning", access_log=False
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

    options = dataclasses.replace(options or ServeOptions(), grpc_host=host, http_host=host, http_port=port)
    for flag, number in (("--port", port), ("--grpc-port", options.grpc_port)):
        if number:
            _check_free(host, number, flag)
    app = create_app(export_dirs, options)
    if on_start is not None:
        on_start(app.state.server.repository)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
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
