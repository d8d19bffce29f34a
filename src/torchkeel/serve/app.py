"""The HTTP server: routes only. Parsing is in ``protocol``, batching in ``batcher``, metrics in
``metrics``. KServe v2 / Triton REST under ``/v2``, KServe v1 under ``/v1``, Prometheus at ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from torchkeel import __version__
from torchkeel.errors import ConfigError
from torchkeel.export.export import read_model_json
from torchkeel.export.formats import load_exported
from torchkeel.serve.batcher import BatchStats, DynamicBatcher, QueueFull, QueueTimeout
from torchkeel.serve.drift import DriftMonitor
from torchkeel.serve.metrics import ServerMetrics
from torchkeel.serve.protocol import (
    HEADER_LENGTH, ProtocolError, TensorSpec, encode_infer, parse_infer, parse_v1, top_k, v1_top_k,
)

VERSION = "1"
# An oversized body is read to its end and dropped, up to 4x the limit (at least 64 MiB) or 5 s,
# before the 413 is sent and the connection closed; past that bound the connection is closed at once.
DRAIN_FACTOR, DRAIN_MIN_BYTES, DRAIN_S = 4, 64 * 2**20, 5.0
PLATFORMS = {"torchscript": "pytorch_libtorch", "onnx": "onnxruntime_onnx", "torch-export": "pytorch_torch_export"}


@dataclass
class ServeOptions:
    max_batch_size: int = 64
    max_queue_delay_ms: float = 0.0
    inline_max_ms: float = 10.0
    max_queue: int = 1024
    queue_timeout_ms: float = 10_000.0
    max_body_mb: float = 16.0
    allow_nonfinite: bool = False
    top_k: int | None = None  # v1 predictions as top-k labels and scores by default


class ModelServer:
    """One exported model behind a dynamic batcher, with its metadata and metrics."""

    def __init__(self, export_dir: str | Path, options: ServeOptions) -> None:
        self.meta = read_model_json(export_dir)
        if not self.meta.get("parity", {}).get("passed"):
            raise ConfigError(f"the export in '{export_dir}' failed its parity check; it is not served")
        self.options = options
        self.name = self.meta["name"]
        self.inputs = [TensorSpec(t["name"], t["datatype"], t["shape"]) for t in self.meta["inputs"]]
        self.outputs = [TensorSpec(t["name"], t["datatype"], t["shape"]) for t in self.meta["outputs"]]
        self.run = load_exported(self.meta["format"], Path(export_dir) / self.meta["file"])
        self.drift = DriftMonitor(self.meta["reference"]) if self.meta.get("reference") else None
        self.batcher = DynamicBatcher(
            self.run, max_batch_size=options.max_batch_size, max_queue_delay_ms=options.max_queue_delay_ms,
            max_queue=options.max_queue, queue_timeout_ms=options.queue_timeout_ms,
            inline_max_ms=options.inline_max_ms, on_batch=self._on_batch,
        )
        self.metrics = ServerMetrics(self.name, VERSION, self.drift, pending=lambda: self.batcher.pending)
        self.ready = False

    def _on_batch(self, stats: BatchStats, inputs: np.ndarray) -> None:
        self.metrics.batch_done(stats.batch_size, stats.num_requests, stats.compute_s, sum(stats.queue_s))
        if self.drift is not None:  # once per batch, not per request
            self.drift.observe(inputs)

    async def predict(self, inputs: np.ndarray) -> np.ndarray:
        return await self.batcher.submit(inputs)


def create_app(export_dir: str | Path, options: ServeOptions | None = None) -> Starlette:
    """The ASGI application serving the export in ``export_dir``."""
    server = ModelServer(export_dir, options or ServeOptions())
    max_body = int(server.options.max_body_mb * 2**20)
    max_drain = max(DRAIN_FACTOR * max_body, DRAIN_MIN_BYTES)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await server.batcher.start()
        gc.freeze()  # the model and imports never become garbage; full collections then stay short
        server.ready = True
        yield
        server.ready = False
        await server.batcher.stop()  # everything already queued is answered first

    async def model_call(request: Request, protocol: str, handler) -> Response:
        start = time.perf_counter()
        server.metrics.request_started()
        failure = None
        try:
            return await handler()
        except ProtocolError as exc:
            failure = "OTHER"
            return error(exc.status, str(exc), exc.headers)
        except QueueFull as exc:
            failure = "REJECTED"
            return error(503, f"server busy: {exc}; retry later", {"Retry-After": "1"})
        except QueueTimeout as exc:
            failure = "REJECTED"
            return error(503, f"request timed out in the queue: {exc}", {"Retry-After": "1"})
        except Exception as exc:  # noqa: BLE001 - the model failed: a server error, named
            failure = "BACKEND"
            return error(500, f"model execution failed: {type(exc).__name__}: {exc}")
        finally:
            server.metrics.request_done(protocol, time.perf_counter() - start, failure)

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

    def check_model(request: Request) -> None:
        name, version = request.path_params["name"], request.path_params.get("version")
        if name != server.name:
            raise ProtocolError(404, f"unknown model '{name}'; this server has '{server.name}'")
        if version not in (None, "", VERSION):
            raise ProtocolError(404, f"model '{name}' has no version '{version}'; it has '{VERSION}'")

    async def v2_server(request: Request) -> Response:
        return JSONResponse({"name": "torchkeel", "version": __version__, "extensions": ["binary_tensor_data"]})

    async def live(request: Request) -> Response:
        return Response(status_code=200)

    async def ready(request: Request) -> Response:
        return Response(status_code=200 if server.ready else 503)

    async def model_metadata(request: Request) -> Response:
        try:
            check_model(request)
        except ProtocolError as exc:
            return error(exc.status, str(exc))
        return JSONResponse({
            "name": server.name, "versions": [VERSION], "platform": PLATFORMS[server.meta["format"]],
            "inputs": [spec(t) for t in server.inputs], "outputs": [spec(t) for t in server.outputs],
        })

    async def model_ready(request: Request) -> Response:
        try:
            check_model(request)
        except ProtocolError as exc:
            return error(exc.status, str(exc))
        return Response(status_code=200 if server.ready else 503)

    async def infer(request: Request) -> Response:
        async def handle() -> Response:
            check_model(request)
            if not server.ready:
                raise QueueFull("the model is not ready")
            body = await read_body(request)
            parsed = parse_infer(body, request.headers.get(HEADER_LENGTH), server.inputs, server.outputs,
                                 server.options.max_batch_size, server.options.allow_nonfinite)
            outputs = await server.predict(parsed.inputs[server.inputs[0].name])
            payload, headers = encode_infer(server.name, VERSION, parsed, {server.outputs[0].name: outputs})
            media = "application/octet-stream" if headers else "application/json"
            return Response(payload, media_type=media, headers=headers)

        return await model_call(request, "v2", handle)

    async def v1_model(request: Request) -> Response:
        name, _, verb = request.path_params["spec"].partition(":")
        if name != server.name:
            return error(404, f"unknown model '{name}'; this server has '{server.name}'")
        if request.method == "GET" and not verb:
            return JSONResponse({"name": server.name, "ready": server.ready})
        if request.method == "POST" and verb == "predict":
            async def handle() -> Response:
                body = await read_body(request)
                batch, parameters = parse_v1(body, server.inputs[0], server.options.max_batch_size,
                                             server.options.allow_nonfinite)
                outputs = await server.predict(batch)
                k = v1_top_k(parameters, server.options.top_k, outputs.shape[1])
                if k is not None:
                    return JSONResponse({"predictions": top_k(outputs, server.meta.get("labels"), k)})
                return JSONResponse({"predictions": outputs.tolist()})

            return await model_call(request, "v1", handle)
        return error(404, f"no route {request.method} /v1/models/{request.path_params['spec']}; use GET "
                          f"/v1/models/{server.name} or POST /v1/models/{server.name}:predict")

    async def metrics(request: Request) -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    routes = [  # the inference routes first: Starlette tries them in order on every request
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
        Route("/v1/models/{spec}", v1_model, methods=["GET", "POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"]),
        Route("/v2", v2_server),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2/models/{name}", model_metadata),
        Route("/v2/models/{name}/versions/{version}", model_metadata),
        Route("/v2/models/{name}/ready", model_ready),
        Route("/v2/models/{name}/versions/{version}/ready", model_ready),
        Route("/metrics", metrics),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_allowed})
    app.state.server = server
    return app


async def _drain(stream: AsyncIterator[bytes], limit_bytes: int, timeout_s: float = DRAIN_S) -> None:
    """Read and drop the rest of a request body: up to ``limit_bytes``, for at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    with contextlib.suppress(asyncio.TimeoutError, ClientDisconnect, StopAsyncIteration):
        while limit_bytes > 0:
            limit_bytes -= len(await asyncio.wait_for(anext(stream), deadline - loop.time()))


def spec(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": t.shape}


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def not_found(request: Request, exc: Exception) -> Response:
    return error(404, f"no route {request.method} {request.url.path}")


async def not_allowed(request: Request, exc: Exception) -> Response:
    return error(405, f"{request.method} is not allowed on {request.url.path}")


@contextlib.contextmanager
def serve_in_background(export_dir: str | Path, options: ServeOptions | None = None):
    """Serve on 127.0.0.1 at a free port from a background thread; yields the base URL.

    For demos and notebooks: the server stops (after answering what is queued) when the block ends.
    """
    import socket
    import threading

    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(export_dir, options), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
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


def serve(export_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, options: ServeOptions | None = None) -> None:
    """Run the server until SIGTERM/SIGINT; queued requests are answered before it returns.

    uvicorn stops accepting on SIGTERM, lets the requests in flight finish (they wait for the
    batcher, which drains its queue at shutdown), then raises the signal again so that the
    process ends as the signal would have it. That re-raised SIGTERM lands in the handler
    installed here and ends ``serve`` normally: a graceful stop exits 0.
    """
    import signal

    import uvicorn

    app = create_app(export_dir, options)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
