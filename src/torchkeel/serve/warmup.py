"""Warm the request path before the server listens: requests through the ASGI app itself.

A model's warm-up forwards (``ServedModel.warm_up``) take the first-call cost out of the model.
The first requests still pay for the code around it — routing, body reading, JSON parsing and
encoding, the batcher's joins — running for the first time: Python specializes a function's
bytecode only after it has run a few times. So, before the server listens, each model answers
``WAVES`` waves of ``CONCURRENCY`` one-sample requests of each protocol (v1 ``predict`` and v2
``infer``), sent to the app in process while nothing else can reach the model (the ASGI
server listens, and gRPC starts, only after the app's start-up). Behind ``keel serve`` the same
requests then go once more through the server's own socket (``warm_over_socket``) before the
readiness probes say ready. They are not counted in the metrics, the drift window or the count
printed at stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchkeel.serve.model import ServedModel, warmup_arrays
from torchkeel.serve.tensors import DTYPES

if TYPE_CHECKING:
    from torchkeel.serve.server import Server

CONCURRENCY = 8
WAVES = 8
BUDGET_S = 5.0
"""A slow model stops its request warm-up after the wave that crosses this (at least one wave)."""

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


@dataclass
class Warmed:
    """What a model's request warm-up did."""

    answered: int
    """Warm-up requests answered with 200."""
    left_out: list[str] = field(default_factory=list)
    """Routes left out, with their first answer other than 200."""
    routes: list[tuple[str, bytes]] = field(default_factory=list, repr=False, compare=False)
    """The requests (path, body) answered with 200: the ones worth sending again over the socket."""


async def warm_requests(app: ASGIApp, model: ServedModel) -> Warmed:
    """Send the model's warm-up requests through ``app``.

    A route whose answer is not 200 is left out from then on, and the model serves as before:
    the warm-up's values are synthetic (zeros), and a model may rightly fail on them (NaN from
    normalizing a zero vector cannot be written as JSON) or a route refuse them as the server
    is configured (v1 ``--top-k`` for a model without class scores). Its clients get the same
    answer for the same request.
    """
    warmed = Warmed(0)
    if any(DTYPES.get(t.datatype) is None for t in model.tensors):
        return warmed  # BF16 inputs travel as binary only: the JSON requests below cannot carry them
    requests = _requests(model)
    concurrency = max(1, min(CONCURRENCY, model.options.max_queue))  # a queue of 2 would refuse the rest
    start = time.perf_counter()
    with model.quiet():
        for _ in range(WAVES):
            for path, body in list(requests):
                answers = await asyncio.gather(*(_post(app, path, body) for _ in range(concurrency)))
                refused = next(((status, text) for status, text in answers if status != 200), None)
                if refused is not None:
                    requests.remove((path, body))
                    warmed.left_out.append(f"POST {path} answered {refused[0]}: {refused[1][:300]}")
                else:
                    warmed.answered += len(answers)
            if not requests or time.perf_counter() - start > BUDGET_S:
                break
    warmed.routes = requests
    return warmed


async def warm_over_socket(server: Server, host: str, port: int) -> None:
    """Once the server listens on ``host:port``, send the requests each model answered in its
    warm-up again through the socket, from ``CONCURRENCY`` keep-alive connections, then let the
    readiness probes say ready (``repository.holding``).

    The in-process warm-up leaves out the ASGI server's own code (HTTP parsing, the protocol's
    writes) and the socket path: without this, the first requests after ready are the first to
    run it, and a replica that joins a load balancer answers them slower. The models answer
    while it runs (only the probes wait), its requests are not counted, and a warm-up that
    cannot reach the socket gives up after ``CONNECT_S`` with a warning: the server is ready
    without it.
    """
    repository = server.repository
    routes = [(path, body) for warmed in server.warmed.values() for path, body in getattr(warmed, "routes", [])]
    try:
        with contextlib.ExitStack() as quiet:
            for model in repository.models.values():
                quiet.enter_context(model.quiet())
            connections = max(1, min(CONCURRENCY, server.options.max_queue))  # as in process: none refused
            await asyncio.to_thread(_send_over_http, _connect_host(host), port, routes, connections)
    except (OSError, http.client.HTTPException) as exc:
        print(f"keel: the request warm-up over {host}:{port} stopped ({exc}); ready without it", file=sys.stderr)
    finally:
        repository.holding = False


CONNECT_S = 10.0
"""How long the socket warm-up waits for the server to listen."""


def _connect_host(host: str) -> str:
    """The address to reach a server listening on ``host`` from the same machine."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _send_over_http(host: str, port: int, routes: list[tuple[str, bytes]], connections: int) -> None:
    """Blocking: ``WAVES`` rounds of ``routes`` from each of ``connections`` keep-alive
    connections at once, until ``BUDGET_S`` is spent."""
    deadline = time.monotonic() + CONNECT_S
    while True:  # the server listens once its start-up (which started this) has returned
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    stop_at = time.monotonic() + BUDGET_S

    def client(_: int) -> None:
        connection = http.client.HTTPConnection(host, port, timeout=30)
        try:
            for _ in range(WAVES):
                for path, body in routes:
                    connection.request("POST", path, body, {"Content-Type": "application/json"})
                    connection.getresponse().read()
                if time.monotonic() > stop_at:
                    break
        finally:
            connection.close()

    with ThreadPoolExecutor(connections, thread_name_prefix="torchkeel-warmup") as pool:
        list(pool.map(client, range(connections)))  # a client's error is raised here


def _requests(model: ServedModel) -> list[tuple[str, bytes]]:
    """A one-sample v1 and v2 request of the model's warm-up values."""
    arrays = warmup_arrays(model.tensors, 1)
    if model.has_named_inputs:
        instance: Any = {name: array[0].tolist() for name, array in arrays.items()}
    else:
        instance = arrays[model.tensor.name][0].tolist()
    v2 = {
        "inputs": [
            {
                "name": t.name,
                "shape": list(arrays[t.name].shape),
                "datatype": t.datatype,
                "data": arrays[t.name].reshape(-1).tolist(),
            }
            for t in model.tensors
        ]
    }
    return [
        (f"/v1/models/{model.name}:predict", json.dumps({"instances": [instance]}).encode()),
        (f"/v2/models/{model.name}/infer", json.dumps(v2).encode()),
    ]


async def _post(app: ASGIApp, path: str, body: bytes) -> tuple[int, str]:
    """One POST through the ASGI app, as a server would hand it over; its status and body."""
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }
    sent, done = False, asyncio.Event()
    status, chunks = 0, []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # as a connection: after the body, the next event is the client leaving
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                done.set()

    await app(scope, receive, send)
    return status, b"".join(chunks).decode(errors="replace")
