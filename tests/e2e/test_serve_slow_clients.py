"""Slow clients: a request must arrive in full within ``--read-timeout-s``, while other clients are served.

Each slow client is a raw socket that sends part of a request (byte by byte, or once and then
nothing) and never finishes; the server must answer it 408 (or, when nothing was sent, close)
within the bound plus slack, and every normal request in that window must succeed.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import numpy as np
import pytest
from serveproc import Server, exported  # noqa: F401 - exported is a fixture

from torchkeel.serve.app import serve_in_background
from torchkeel.serve.model import ServeOptions

BOUND_S = 1.5
SLACK_S = 6.0  # generous: a loaded CI machine; the old server never answers at all
TRICKLE_S = 0.1  # between the bytes a trickling client sends

V1_BODY = json.dumps({"instances": np.zeros((1, 32)).tolist()}).encode()


def post(path: str, body: bytes, length: int | None = None) -> bytes:
    """A POST's request line, headers and ``body``, declaring ``length`` bytes (default: the body's)."""
    size = len(body) if length is None else length
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    )
    return head.encode() + body


class SlowClient(threading.Thread):
    """Sends ``at_once``, then ``trickle`` one byte at a time (and then nothing), or ``later`` in
    one piece a third of the bound on, and reads what comes back until the server closes or
    ``SLACK_S`` past the bound."""

    def __init__(self, port: int, at_once: bytes = b"", trickle: bytes = b"", later: bytes = b"") -> None:
        super().__init__(daemon=True)
        self.port, self.at_once, self.trickle, self.later = port, at_once, trickle, later
        self.received = b""
        self.closed_after_s: float | None = None  # None: still open when the client gave up

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=TRICKLE_S) as sock:
            start = time.monotonic()
            sock.sendall(self.at_once)
            pending = list(self.trickle)
            while time.monotonic() - start < BOUND_S + SLACK_S:
                if self.later and time.monotonic() - start > BOUND_S / 3:
                    sock.sendall(self.later)
                    self.later = b""
                if pending:
                    try:
                        sock.send(bytes([pending.pop(0)]))
                    except OSError:  # closed by the server while we send
                        pass
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    self.closed_after_s = time.monotonic() - start
                    return
                self.received += chunk

    def responses(self) -> list[tuple[int, dict]]:
        """The (status, JSON body) of each response received, in order."""
        out, rest = [], self.received
        while rest:
            head, _, rest = rest.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            length = next(int(v) for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length")
            out.append((int(lines[0].split()[1]), json.loads(rest[:length])))
            rest = rest[length:]
        return out


def slow_clients(port: int) -> dict[str, SlowClient]:
    infer = "/v2/models/tiny/infer"
    first = post("/v1/models/tiny:predict", V1_BODY)
    return {
        "sends nothing": SlowClient(port),
        "headers trickled": SlowClient(port, trickle=post(infer, b"{}")[:-8]),
        "body stalled": SlowClient(port, at_once=post(infer, b"{", length=1000)),
        "body trickled": SlowClient(
            port, at_once=post("/v1/models/tiny:predict", b"", length=len(V1_BODY)), trickle=V1_BODY[:-1]
        ),
        "LM route body stalled": SlowClient(port, at_once=post("/v1/completions", b'{"prompt"', length=500)),
        "keep-alive, second request trickled": SlowClient(port, at_once=first, trickle=post(infer, b"{}")[:-1]),
        "in two parts within the bound": SlowClient(port, at_once=first[:-10], later=first[-10:]),
    }


def check_slow_clients(clients: dict[str, SlowClient]) -> None:
    for name, client in clients.items():
        client.join(BOUND_S + SLACK_S + 5)
        statuses = [status for status, _ in client.responses()]
        if name == "in two parts within the bound":  # slow, but in time: answered as usual
            assert statuses == [200], (name, statuses)
            continue
        assert client.closed_after_s is not None, f"{name}: still open {BOUND_S + SLACK_S:.1f} s on"
        if name == "sends nothing":
            assert statuses == [], name
            continue
        assert statuses == ([200, 408] if name.startswith("keep-alive") else [408]), (name, statuses)
        assert "--read-timeout-s" in client.responses()[-1][1]["error"], name


def test_slow_clients_time_out_while_others_are_served(exported):
    server = Server(exported[0], "--read-timeout-s", str(BOUND_S))
    try:
        clients = slow_clients(server.port)
        for client in clients.values():
            client.start()
        statuses: list[int] = []
        deadline = time.monotonic() + BOUND_S + 1.0  # the window in which the slow clients hold on
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        while time.monotonic() < deadline:  # one keep-alive client at its usual pace
            connection.request("POST", "/v1/models/tiny:predict", V1_BODY, {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
        connection.close()
        fresh = [server.request("POST", "/v1/models/tiny:predict", V1_BODY)[0] for _ in range(5)]
        check_slow_clients(clients)
        assert set(statuses) == {200} and len(statuses) >= 10, statuses
        assert fresh == [200] * 5
        assert server.request("POST", "/v1/models/tiny:predict", V1_BODY)[0] == 200  # still serving
    finally:
        assert server.stop() == 0


def test_a_slow_inference_or_response_is_not_cut(exported):
    """The bound is on reading the request only: a forward slower than it still answers."""
    env = {"TORCHKEEL_TEST_FORWARD_SLEEP_S": str(BOUND_S * 2)}
    server = Server(exported[0], "--read-timeout-s", str(BOUND_S), "--warmup-batch-sizes", "none", env=env)
    try:
        status, body, _ = server.request("POST", "/v1/models/tiny:predict", V1_BODY)
        assert status == 200 and len(json.loads(body)["predictions"]) == 1
    finally:
        assert server.stop() == 0


def test_a_bound_that_is_not_a_positive_number_is_a_usage_error(exported, tmp_path):
    from keelproc import run_keel

    for bad in ("0", "soon"):  # -1 and inf: the same check, one process each
        result = run_keel("serve", str(exported[0]), "--read-timeout-s", bad, cwd=tmp_path, timeout=60)
        assert result.returncode == 2, (bad, result.stderr[-500:])
        assert "--read-timeout-s" in result.stderr and "number of seconds" in result.stderr, result.stderr[-500:]


def test_serve_in_background_bounds_the_read_too(exported):
    with serve_in_background(exported[0], ServeOptions(read_timeout_s=BOUND_S)) as url:
        port = int(url.rsplit(":", 1)[1])
        client = SlowClient(port, at_once=post("/v2/models/tiny/infer", b"{", length=1000))
        client.start()
        check_slow_clients({"body stalled": client})


STALLED_CALLS = 24  # more than the old threaded server's 16 handler threads
INFER = "/inference.GRPCInferenceService/ModelInfer"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame
HEADERS_BEGUN = b"\x00\x00\x01\x01\x00\x00\x00\x00\x01\x82"  # HEADERS on stream 1, without END_HEADERS


def never_sent(release: threading.Event):
    """A request stream whose message never comes: the call's headers go out, then nothing."""
    release.wait(BOUND_S + SLACK_S + 10)
    yield from ()


def sent_late(delay_s: float):
    """A request stream whose one message (an empty ServerLiveRequest) comes ``delay_s`` late."""
    time.sleep(delay_s)
    yield b""


def test_stalled_grpc_calls_end_while_others_are_served(exported):
    import grpc
    import tritonclient.grpc as tritongrpc

    server = Server(exported[0], "--read-timeout-s", str(BOUND_S), grpc=True)
    release = threading.Event()
    channels = [grpc.insecure_channel(server.grpc_url) for _ in range(3)]  # several connections stall
    client = tritongrpc.InferenceServerClient(server.grpc_url)
    connections = {  # raw connections that stall before any call
        "sends nothing": SlowClient(server.grpc_port),
        "preface only": SlowClient(server.grpc_port, at_once=PREFACE),
        "headers begun": SlowClient(server.grpc_port, at_once=PREFACE + SETTINGS + HEADERS_BEGUN),
    }
    try:
        start = time.monotonic()
        for connection in connections.values():
            connection.start()
        stalled = [
            channels[i % len(channels)].stream_unary(INFER).future(never_sent(release)) for i in range(STALLED_CALLS)
        ]
        time.sleep(0.3)  # their headers are in
        inputs = [tritongrpc.InferInput("input", [1, 32], "FP32")]
        inputs[0].set_data_from_numpy(np.zeros((1, 32), dtype=np.float32))
        served = 0
        while time.monotonic() - start < BOUND_S + 1.0:  # a normal client at its usual pace meanwhile
            result = client.infer("tiny", inputs, client_timeout=SLACK_S)
            assert result.as_numpy("output").shape[0] == 1
            served += 1
        for call in stalled:  # each ends within the bound, told why
            call.exception(timeout=max(0.1, start + BOUND_S + SLACK_S - time.monotonic()))
            assert call.done(), f"a stalled call still open {BOUND_S + SLACK_S:.1f} s on"
            assert call.code() == grpc.StatusCode.DEADLINE_EXCEEDED, call.code()
            assert "--read-timeout-s" in call.details(), call.details()
        for name, connection in connections.items():
            connection.join(BOUND_S + SLACK_S + 5)
            assert connection.closed_after_s is not None, f"{name}: still open {BOUND_S + SLACK_S:.1f} s on"
        assert served >= 10, served
        live = channels[0].stream_unary("/inference.GRPCInferenceService/ServerLive")
        assert live(sent_late(BOUND_S / 3), timeout=SLACK_S) == b"\x08\x01"  # late, but in time: live=true
        with pytest.raises(grpc.RpcError) as empty:
            live(iter(()), timeout=SLACK_S)
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT, empty.value
        time.sleep(BOUND_S + 0.5)  # the client's connection idles past the bound: closed, and it reconnects
        assert client.is_server_live() and client.infer("tiny", inputs).as_numpy("output").shape[0] == 1
    finally:
        release.set()
        client.close()
        for channel in channels:
            channel.close()
        assert server.stop() == 0
