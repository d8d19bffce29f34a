"""``keel serve`` as KServe runs it, warmed up before it is ready, and taken away under load.

- As a custom predictor: ``STORAGE_URI`` names the models when no directory is given,
  ``--model_name`` names the model, v1 ``GET /v1/models/{name}`` answers ``{"name", "ready"}``.
  (KServe's defaults, all interfaces on 8080 and 8081, are checked without binding them: tests
  listen on 127.0.0.1 only.)
- Warm-up: a model is ready only after it ran one batch of every warm-up size, and the server
  has sent it requests of each protocol through its own app, then (once it listens) through
  its own socket (not counted anywhere).
- Scale-down: SIGTERM while 64 clients send; every request the server accepted is answered.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serveproc import Server, exported, free_port  # noqa: F401 - exported is a fixture

from torchkeel.errors import ConfigError
from torchkeel.serve.app import create_app
from torchkeel.serve.drift import DriftMonitor
from torchkeel.serve.kserve import LOCAL, is_kserve, kserve_defaults
from torchkeel.serve.metrics import ModelMetrics, ServerMetrics
from torchkeel.serve.model import ServeOptions
from torchkeel.serve.repository import ModelRepository
from torchkeel.serve.warmup import CONCURRENCY, WAVES, Warmed, warm_requests

BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 32], "datatype": "FP32", "data": [0.0] * 32}]})


def test_under_kserve_the_defaults_are_all_interfaces_8080_8081_and_mnt_models(tmp_path):
    assert not is_kserve({}) and LOCAL.host == "127.0.0.1"
    assert is_kserve({"STORAGE_URI": "s3://bucket/model"})
    copied = kserve_defaults({"STORAGE_URI": "s3://bucket/model"}, mount=str(tmp_path))
    assert (copied.host, copied.http_port, copied.grpc_port, copied.model_dirs) == (
        "0.0.0.0",
        8080,
        8081,
        [str(tmp_path)],
    )
    # Nothing copied to the mount: a local STORAGE_URI (a volume) is served where it is.
    local = kserve_defaults({"STORAGE_URI": "file:///models/digits"}, mount=str(tmp_path / "absent"))
    assert local.model_dirs == ["/models/digits"]


def test_storage_uri_and_model_name_as_kserve_passes_them(exported):
    srv = Server([], "--host", "127.0.0.1", "--model_name", "digits", env={"STORAGE_URI": f"file://{exported[0]}"})
    try:
        status, body, _ = srv.request("GET", "/v1/models/digits")
        assert status == 200 and {"name": "digits", "ready": True}.items() <= json.loads(body).items()
        status, body, _ = srv.request("POST", "/v2/models/digits/infer", BODY)
        assert status == 200 and json.loads(body)["model_name"] == "digits"
        assert srv.request("GET", "/v1/models/tiny")[0] == 404
    finally:
        assert srv.stop() == 0


def test_model_name_names_one_model_only(exported):
    with pytest.raises(ConfigError, match="--model_name 'digits' names one model, and 2 exports were given"):
        repository(exported, ServeOptions(model_name="digits"), sources=[exported[0], exported[0]])


def repository(exported, options, sources=None):
    return ModelRepository(sources or [exported[0]], options, ServerMetrics(), ThreadPoolExecutor(1))


def test_a_model_is_ready_only_after_every_warmup_batch_size_ran(exported):
    repo = repository(exported, ServeOptions(max_batch_size=12))
    (model,) = repo.models.values()
    seen, forward = [], model.run

    def recording(batch):
        assert not model.ready  # warm-up happens before ready
        seen.append(batch.shape)
        return forward(batch)

    model.run = recording
    asyncio.run(repo.start())
    assert [shape[0] for shape in seen] == [1, 2, 4, 8, 12] and all(shape[1:] == (32,) for shape in seen)
    assert model.ready and repo.ready
    asyncio.run(repo.stop())
    assert ServeOptions(warmup_batch_sizes=(64, 3), max_batch_size=16).warmup_sizes() == [3, 16]
    assert ServeOptions(warmup_batch_sizes=()).warmup_sizes() == []


def test_a_model_whose_warmup_fails_is_unavailable_with_the_reason(exported):
    repo = repository(exported, ServeOptions(max_batch_size=4))

    def broken(batch):
        raise RuntimeError("Expected all tensors to be on the same device")

    next(iter(repo.models.values())).run = broken
    asyncio.run(repo.start())
    assert not repo.ready and not repo.models
    assert "warm-up failed: Expected all tensors to be on the same device" in repo.unavailable[0].reason


def test_requests_through_the_app_warm_the_request_path_and_are_not_counted(exported, monkeypatch):
    # Every wave is sent and none times out in the queue, however busy the machine is: the
    # warm-up's time budget and the queue's timeout are wall-clock limits, not what is tested.
    monkeypatch.setattr("torchkeel.serve.warmup.BUDGET_S", 600.0)
    app = create_app(exported[0], ServeOptions(max_batch_size=8, queue_timeout_ms=600_000))
    server = app.state.server
    (model,) = server.repository.models.values()
    batches, forward = [], model.batcher.run_batch
    counted = []  # (metrics or drift object, what it was told): the counting code runs, on scratch objects
    for cls, name in ((ModelMetrics, "request_done"), (ModelMetrics, "batch_done"), (DriftMonitor, "observe")):
        monkeypatch.setattr(cls, name, _recorded(getattr(cls, name), name, counted))
    real_metrics, real_drift = model.metrics, model.drift
    assert real_drift is not None  # the export carries reference statistics

    def recording(batch):
        batches.append(len(batch))
        return forward(batch)

    async def main():
        await server.repository.start()  # the forward warm-up
        model.batcher.run_batch = recording
        warmed = await warm_requests(app, model)
        await server.repository.stop()
        return warmed

    assert asyncio.run(main()) == Warmed(2 * WAVES * CONCURRENCY)  # v1 and v2, every one answered 200
    assert sum(batches) == 2 * WAVES * CONCURRENCY and max(batches) > 1  # concurrent: batched as clients are
    assert sum(name == "request_done" for _, name in counted) == 2 * WAVES * CONCURRENCY
    assert sum(name == "batch_done" for _, name in counted) == sum(name == "observe" for _, name in counted) > 0
    assert not any(target is real_metrics or target is real_drift for target, _ in counted)
    assert model.metrics is real_metrics and model.drift is real_drift and real_drift._samples == 0
    assert server.metrics.answered() == (0, 0, 0)
    text = server.metrics.render().decode()
    assert 'nv_inference_exec_count{model="tiny",version="1"} 0.0' in text
    assert 'nv_inference_request_success{model="tiny",version="1"} 0.0' in text


def _recorded(method, name: str, calls: list):
    def recording(self, *args, **kwargs):
        calls.append((self, name))
        return method(self, *args, **kwargs)

    return recording


def test_a_route_that_fails_on_the_warmup_values_is_left_out_and_the_model_still_serves(exported, monkeypatch):
    # A model that normalizes its input (x / x.norm()) answers NaN for zeros: v1 cannot write NaN
    # as JSON (500). The model is fine for real inputs: it must stay in service.
    monkeypatch.setattr("torchkeel.serve.warmup.BUDGET_S", 600.0)  # every wave, however busy the machine
    app = create_app(exported[0], ServeOptions(max_batch_size=8, queue_timeout_ms=600_000))
    (model,) = app.state.server.repository.models.values()
    forward = model.batcher.run_batch

    def normalizing(batch):  # the model's first step: inputs scaled to unit length
        return forward(batch / np.linalg.norm(batch, axis=1, keepdims=True))

    def refusing(scope, receive, send):  # the app, except that v2 refuses as a misconfigured route would
        if scope["path"].startswith("/v2/"):
            return _answer(send, 400, b"parameters.top_k needs one score per class")
        return app(scope, receive, send)

    async def main():
        await app.state.server.repository.start()
        model.batcher.run_batch = normalizing
        try:
            return await warm_requests(app, model), await warm_requests(refusing, model), model.ready
        finally:
            await app.state.server.repository.stop()

    with np.errstate(invalid="ignore"):
        nan_v1, refused_v2, ready = asyncio.run(main())
    assert nan_v1.answered == WAVES * CONCURRENCY  # v2 carries on
    nan = (
        'POST /v1/models/tiny:predict answered 500: {"error":"model execution failed: ValueError: Out of range '
        'float values are not JSON compliant"}'
    )
    assert nan_v1.left_out == [nan]
    assert refused_v2.answered == 0 and len(refused_v2.left_out) == 2  # v1 (NaN) and v2 (refused) both out
    assert (
        refused_v2.left_out[1] == "POST /v2/models/tiny/infer answered 400: parameters.top_k needs one score per class"
    )
    assert ready


def _uvicorn(app, port: int):
    """``app`` served by uvicorn on 127.0.0.1:``port`` from a thread, as ``keel serve`` runs it."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    return server, thread


def _get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _when_ready(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if _get(port, "/v2/health/ready")[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.02)
    raise AssertionError("the server never said ready")


def test_behind_keel_serve_the_requests_go_again_through_the_socket_before_ready(exported):
    port = free_port()
    app = create_app(exported[0], ServeOptions(max_batch_size=8, http_port=port))
    repository = app.state.server.repository
    through_socket = []  # what reached the server over TCP: (path, client port, ready then)

    async def listening(scope, receive, send):  # the app as uvicorn calls it; the in-process warm-up skips this
        if scope["type"] == "http":
            through_socket.append((scope["path"], scope["client"][1], repository.ready))
        await app(scope, receive, send)

    server, thread = _uvicorn(listening, port)
    try:
        _when_ready(port)
        warmup = [row for row in through_socket if row[0] != "/v2/health/ready"]
        paths = sorted({path for path, _, _ in warmup})
        assert paths == ["/v1/models/tiny:predict", "/v2/models/tiny/infer"]
        assert len(warmup) == 2 * WAVES * CONCURRENCY  # each route, WAVES times from every connection
        assert len({client for _, client, _ in warmup}) == CONCURRENCY and all(client for _, client, _ in warmup)
        assert not any(ready for _, _, ready in warmup)  # the probes were told "not ready" all along
        probes = [ready for path, _, ready in through_socket if path == "/v2/health/ready"]
        assert probes[-1] and not any(probes[:-1])
        assert app.state.server.metrics.answered() == (0, 0, 0)  # not counted
        status, text = _get(port, "/v1/models/tiny")
        assert status == 200 and {"name": "tiny", "ready": True}.items() <= json.loads(text).items()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("POST", "/v2/models/tiny/infer", BODY, {"Content-Type": "application/json"})
        assert connection.getresponse().status == 200
        connection.close()
        assert app.state.server.metrics.answered()[0] == 1  # a client's request is
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_socket_warmup_that_cannot_connect_gives_up_and_the_server_is_ready(exported, monkeypatch, capfd):
    from starlette.testclient import TestClient

    from torchkeel.serve import warmup

    monkeypatch.setattr(warmup, "CONNECT_S", 0.2)
    nobody = free_port()  # the app thinks it listens there; nothing does
    app = create_app(exported[0], ServeOptions(max_batch_size=4, http_port=nobody))
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.02)
        assert client.post("/v2/models/tiny/infer", content=BODY).status_code == 200
    err = capfd.readouterr().err
    assert f"keel: the request warm-up over 127.0.0.1:{nobody} stopped (" in err
    assert err.rstrip().endswith("ready without it")


async def _answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})


def test_grpc_starts_after_the_request_warmup(exported):
    server = create_app(exported[0], ServeOptions(max_batch_size=4, grpc_port=free_port())).state.server
    calls = []

    async def warm(model):
        calls.append((model.name, model.ready, server.grpc))

    async def start_and_stop() -> None:  # gRPC runs on the loop it started on
        await server.start(warm=warm)
        assert calls == [("tiny", True, None)]  # warmed once its forward warm-up made it ready, before gRPC
        assert server.grpc is not None and server.repository.ready
        await server.stop()

    asyncio.run(start_and_stop())


def test_sigterm_while_64_clients_send_answers_every_request_it_accepted(exported):
    srv = Server(exported[0], "--max-batch-size", "16")
    outcomes: dict[str, int] = {}
    lock, stop = threading.Lock(), threading.Event()

    def note(kind: str) -> None:
        with lock:
            outcomes[kind] = outcomes.get(kind, 0) + 1

    def client() -> None:
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            connection = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            try:
                connection.connect()
            except ConnectionRefusedError:
                note("refused")  # not accepted: the listener is closed
                return
            try:
                connection.request("POST", "/v2/models/tiny/infer", BODY, {"Connection": "close"})
                response = connection.getresponse()
                response.read()
                note(str(response.status))
            except (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError) as exc:
                note(type(exc).__name__)  # accepted, then dropped: what must not happen
            finally:
                connection.close()

    terminated = threading.Event()
    threads = [threading.Thread(target=client) for _ in range(64)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while outcomes.get("200", 0) <= 64 and time.monotonic() < deadline:  # the clients are all sending
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    terminated.set()
    code = srv.proc.wait(timeout=60)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    srv.stop()
    assert code == 0
    # The server's own count of the requests it read and answered, printed as it stops.
    line = next(line for line in srv.stderr.splitlines() if line.startswith("keel: stopped; answered"))
    server_answered = int(line.split()[3])
    statuses = {k: v for k, v in outcomes.items() if k.isdigit()}
    assert statuses == {"200": server_answered} and server_answered > 64, (outcomes, line)
    assert line.endswith(", 0 unanswered")  # nothing the server read was left without an answer
    # The others never reached the server: refused once the listener closed, or reset while they
    # waited in the kernel's queue of connections the server had not accepted yet.
    assert set(outcomes) <= {"200", "refused", "ConnectionResetError"}, outcomes
