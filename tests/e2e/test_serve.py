"""``keel serve`` as a subprocess on 127.0.0.1, driven by the real ``tritonclient`` and by raw HTTP."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as tritonhttp
from serveproc import Server, eager_rows, exported, metric  # noqa: F401 - exported is a fixture


@pytest.fixture(scope="module")
def server(exported):
    # The model on its worker thread: requests that arrive during a forward queue up and are
    # batched, which the concurrency test checks. (The tiny model inline is faster than the
    # test's clients, so it would never need to batch; the fuzz and 413 servers run inline.)
    srv = Server(exported[0], "--max-queue-delay-ms", "5", "--inline-max-ms", "0")
    yield srv
    assert srv.stop() == 0


def inputs(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 32)).astype(np.float32)


def test_tritonclient_metadata_readiness_and_infer(server, exported):
    client = tritonhttp.InferenceServerClient(server.url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    meta = client.get_model_metadata("tiny")
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 32]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}]
    for binary in (True, False):
        x = inputs(3, seed=int(binary))
        tensor = tritonhttp.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        wanted = tritonhttp.InferRequestedOutput("output", binary_data=binary)
        result = client.infer("tiny", [tensor], outputs=[wanted], request_id=f"req-{binary}")
        np.testing.assert_allclose(result.as_numpy("output"), eager_rows(exported[1], x), atol=1e-5)
        assert result.get_response()["id"] == f"req-{binary}"
    client.close()


def test_kserve_v1_predict(server, exported):
    x = inputs(2, seed=5)
    status, body, _ = server.request("POST", "/v1/models/tiny:predict", json.dumps({"instances": x.tolist()}))
    assert status == 200
    np.testing.assert_allclose(np.array(json.loads(body)["predictions"]), eager_rows(exported[1], x), atol=1e-5)
    status, body, _ = server.request(
        "POST", "/v1/models/tiny:predict", json.dumps({"instances": x.tolist(), "parameters": {"top_k": 2}})
    )
    top = json.loads(body)["predictions"]
    assert status == 200 and len(top) == 2 and len(top[0]["labels"]) == 2
    assert top[0]["labels"][0] == str(int(eager_rows(exported[1], x)[0].argmax()))
    status, body, _ = server.request("GET", "/v1/models/tiny")
    assert status == 200 and {"name": "tiny", "ready": True}.items() <= json.loads(body).items()


def test_64_concurrent_clients_each_get_their_own_answer(server, exported):
    results, errors = {}, []

    def client(i: int) -> None:
        try:
            x = inputs(1, seed=1000 + i)
            body = json.dumps({"inputs": [{"name": "input", "shape": [1, 32], "datatype": "FP32", "data": x.tolist()}]})
            for _ in range(5):
                status, payload, _ = server.request("POST", "/v2/models/tiny/infer", body)
                assert status == 200, payload
                results.setdefault(i, []).append((x, np.array(json.loads(payload)["outputs"][0]["data"]).reshape(1, 4)))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    before = metric(server, "nv_inference_exec_count")
    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and len(results) == 64
    for pairs in results.values():
        for x, got in pairs:
            np.testing.assert_allclose(got, eager_rows(exported[1], x), atol=1e-5)
    executions = metric(server, "nv_inference_exec_count") - before
    assert executions < 64 * 5  # requests were batched together


def v2(data, shape=(1, 32), datatype="FP32", name="input", **extra):
    return json.dumps({"inputs": [{"name": name, "shape": list(shape), "datatype": datatype, "data": data}], **extra})


GOOD = [0.0] * 32
BAD_INPUTS = [
    ("malformed json", "/v2/models/tiny/infer", "{not json", {}, 400, "not valid JSON"),
    ("json array", "/v2/models/tiny/infer", "[1, 2]", {}, 400, "must be a JSON object"),
    ("no inputs", "/v2/models/tiny/infer", "{}", {}, 400, "'inputs' must be a non-empty list"),
    ("wrong input name", "/v2/models/tiny/infer", v2(GOOD, name="x"), {}, 400, "inputs[0].name 'x' is not an input"),
    ("wrong datatype", "/v2/models/tiny/infer", v2(GOOD, datatype="INT64"), {}, 400, "takes FP32"),
    ("unknown datatype", "/v2/models/tiny/infer", v2(GOOD, datatype="FP8"), {}, 400, "inputs[0].datatype is 'FP8'"),
    ("wrong rank", "/v2/models/tiny/infer", v2(GOOD, shape=(32,)), {}, 400, "takes [N, 32]"),
    ("wrong sample shape", "/v2/models/tiny/infer", v2([0.0] * 16, shape=(1, 16)), {}, 400, "shape is [1, 16]"),
    ("negative shape", "/v2/models/tiny/infer", v2(GOOD, shape=(-1, 32)), {}, 400, "non-negative integers"),
    ("count mismatch", "/v2/models/tiny/infer", v2([0.0] * 31), {}, 400, "has 31 values; shape [1, 32] needs 32"),
    ("non-numeric data", "/v2/models/tiny/infer", v2(["a"] * 32), {}, 400, "not FP32"),
    ("nan values", "/v2/models/tiny/infer", v2(GOOD[:31] + [float("nan")]), {}, 400, "NaN/Inf"),
    ("too many samples", "/v2/models/tiny/infer", v2([0.0] * 32 * 65, shape=(65, 32)), {}, 400, "between 1 and 64"),
    ("zero samples", "/v2/models/tiny/infer", v2([], shape=(0, 32)), {}, 400, "between 1 and 64"),
    (
        "unknown output",
        "/v2/models/tiny/infer",
        v2(GOOD, outputs=[{"name": "logits"}]),
        {},
        400,
        "outputs[0].name 'logits'",
    ),
    (
        "binary size mismatch",
        "/v2/models/tiny/infer",
        json.dumps(
            {
                "inputs": [
                    {"name": "input", "shape": [1, 32], "datatype": "FP32", "parameters": {"binary_data_size": 128}}
                ]
            }
        ),
        {"Inference-Header-Content-Length": "X"},
        400,
        "must be an integer",
    ),
    (
        "bad header length",
        "/v2/models/tiny/infer",
        v2(GOOD),
        {"Inference-Header-Content-Length": "999999"},
        400,
        "outside the body",
    ),
    ("unknown model", "/v2/models/nope/infer", v2(GOOD), {}, 404, "unknown model 'nope'"),
    ("unknown version", "/v2/models/tiny/versions/7/infer", v2(GOOD), {}, 404, "no version '7'"),
    (
        "nested 5000 deep",
        "/v2/models/tiny/infer",
        '{"inputs": ' + "[" * 5000 + "]" * 5000 + "}",
        {},
        400,
        "nested too deeply",
    ),
    (
        "v1 nested 5000 deep",
        "/v1/models/tiny:predict",
        '{"instances": ' + "[" * 5000 + "]" * 5000 + "}",
        {},
        400,
        "nested too deeply",
    ),
    ("digits past the limit", "/v2/models/tiny/infer", '{"id": ' + "9" * 5000 + "}", {}, 400, "not valid JSON"),
    (
        "inputs parameters a string",
        "/v2/models/tiny/infer",
        json.dumps(
            {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [1, 32],
                        "datatype": "FP32",
                        "data": GOOD,
                        "parameters": "binary_data_size",
                    }
                ]
            }
        ),
        {},
        400,
        "inputs[0].parameters' must be an object",
    ),
    (
        "unhashable input name",
        "/v2/models/tiny/infer",
        json.dumps({"inputs": [{"name": ["input"], "shape": [1, 32], "datatype": "FP32", "data": GOOD}]}),
        {},
        400,
        "is not an input of the model",
    ),
    ("v1 no instances", "/v1/models/tiny:predict", json.dumps({"rows": []}), {}, 400, "'instances' must be"),
    ("v1 ragged", "/v1/models/tiny:predict", json.dumps({"instances": [[0.0] * 32, [0.0] * 3]}), {}, 400, "ragged"),
    (
        "v1 null value",
        "/v1/models/tiny:predict",
        json.dumps({"instances": [GOOD, [0.0] * 5 + [None] + [0.0] * 26]}),
        {},
        400,
        "instances[1][5] is null; send a number",
    ),
    (
        "v1 boolean value",
        "/v1/models/tiny:predict",
        json.dumps({"instances": [[True] + [0.0] * 31]}),
        {},
        400,
        "instances[0][0] is a boolean; send a number",
    ),
    (
        "v1 bad top_k",
        "/v1/models/tiny:predict",
        json.dumps({"instances": [GOOD], "parameters": {"top_k": 99}}),
        {},
        400,
        "top_k must be an integer from 1 to 4",
    ),
    ("v1 unknown verb", "/v1/models/tiny:explain", json.dumps({"instances": [GOOD]}), {}, 404, "no route POST"),
]


@pytest.mark.parametrize(
    ("kind", "path", "body", "headers", "status", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_is_a_4xx_that_names_the_problem(server, kind, path, body, headers, status, message):
    got, payload, _ = server.request("POST", path, body, headers)
    assert got == status, payload
    assert message in json.loads(payload)["error"]
    assert server.request("POST", "/v2/models/tiny/infer", v2(GOOD))[0] == 200  # still serving


def test_binary_input_with_the_wrong_byte_count(server):
    header = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 32], "datatype": "FP32", "parameters": {"binary_data_size": 64}}]}
    ).encode()
    status, payload, _ = server.request(
        "POST", "/v2/models/tiny/infer", header + b"\0" * 64, {"Inference-Header-Content-Length": str(len(header))}
    )
    assert status == 400 and "64 binary bytes for 32 FP32 values (need 128)" in json.loads(payload)["error"]


def test_body_too_large_is_a_413_the_client_can_read(exported):
    """8 MB to a 1 MB limit: the server reads and drops the rest, answers 413 and closes."""
    srv = Server(exported[0], "--max-body-mb", "1")
    try:
        url = f"http://{srv.url}/v2/models/tiny/infer"
        for body in (b"[" * (8 * 2**20), b" " * (2 * 2**20)):
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=30)
            assert info.value.code == 413 and info.value.headers["Connection"] == "close"
            assert "the limit is 1048576 bytes" in json.loads(info.value.read())["error"]
        chunked = urllib.request.Request(url, data=iter([b" " * 2**20] * 3), headers={"Transfer-Encoding": "chunked"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(chunked, timeout=30)
        assert info.value.code == 413 and "more than 1048576 bytes" in json.loads(info.value.read())["error"]
        assert srv.request("POST", "/v2/models/tiny/infer", v2(GOOD))[0] == 200
    finally:
        assert srv.stop() == 0


def test_wrong_method_and_route(server):
    assert server.request("GET", "/v2/models/tiny/infer")[0] == 405
    status, body = server.request("GET", "/v1/models/tiny:predict")[:2]
    assert status == 405 and "POST the instances" in json.loads(body)["error"]
    assert server.request("GET", "/v3")[0] == 404


def test_overload_gives_503_and_memory_settles(exported):
    # The model thread and a batching wait, so that a burst of 64 clients overfills a queue of 2.
    srv = Server(exported[0], "--max-queue", "2", "--max-queue-delay-ms", "20", "--inline-max-ms", "0")
    try:

        def burst() -> list[int]:
            statuses: list[int] = []
            body = v2(GOOD)

            def client() -> None:
                for _ in range(10):
                    statuses.append(srv.request("POST", "/v2/models/tiny/infer", body)[0])

            threads = [threading.Thread(target=client) for _ in range(64)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            return statuses

        burst()  # warm-up: allocator pools and caches reach their working size
        baseline = srv.rss_bytes()
        statuses = burst()
        assert set(statuses) <= {200, 503} and statuses.count(503) > 0 and statuses.count(200) > 0
        status, _, headers = srv.request("POST", "/v2/models/tiny/infer", v2(GOOD))
        assert status == 200
        assert metric(srv, "nv_inference_request_failure", reason="REJECTED") >= statuses.count(503)
        assert srv.rss_bytes() <= baseline * 1.10 + 16 * 2**20
    finally:
        assert srv.stop() == 0


def test_sigterm_answers_everything_in_flight_over_rest_and_grpc(exported):
    import tritonclient.grpc as tritongrpc

    # Every forward takes 2 s (a test seam): the burst of 24 is certainly in the server when SIGTERM comes.
    slow = {"TORCHKEEL_TEST_FORWARD_SLEEP_S": "2"}
    srv = Server(exported[0], "--inline-max-ms", "0", "--warmup-batch-sizes", "none", grpc=True, env=slow)
    statuses: list[int] = []
    answers: list[np.ndarray] = []
    x = np.random.default_rng(3).normal(size=(1, 32)).astype(np.float32)
    channels = [tritongrpc.InferenceServerClient(srv.grpc_url) for _ in range(8)]
    assert all(channel.is_server_ready() for channel in channels)  # connected before the burst

    def client() -> None:
        statuses.append(srv.request("POST", "/v2/models/tiny/infer", v2(GOOD))[0])

    def grpc_client(channel) -> None:
        tensor = tritongrpc.InferInput("input", [1, 32], "FP32")
        tensor.set_data_from_numpy(x)
        answers.append(channel.infer("tiny", [tensor], client_timeout=60).as_numpy("output"))
        channel.close()

    try:
        threads = [threading.Thread(target=client) for _ in range(16)] + [
            threading.Thread(target=grpc_client, args=(channel,)) for channel in channels
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        # Wait until the requests are in the server: queued behind, or in, a 2 s forward.
        while metric(srv, "nv_inference_pending_request_count") < 16 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert metric(srv, "nv_inference_pending_request_count") >= 16
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        # One SIGTERM, as Kubernetes sends: a second one (srv.stop() sends it to a process still
        # running) could land while the process exits, after it put the default handler back.
        assert srv.proc.wait(timeout=60) == 0
        srv.stop()
        assert statuses == [200] * 16 and len(answers) == 8
        for answer in answers:
            np.testing.assert_allclose(answer, eager_rows(exported[1], x), atol=1e-5)
    finally:
        if srv.proc.poll() is None:  # a failed assertion must not leave the server running
            srv.proc.kill()
            srv.proc.wait(timeout=30)


def test_dashboard_and_alerts_use_metrics_the_server_exposes(server):
    import re

    import yaml

    root = Path(__file__).resolve().parents[2] / "deploy"
    dashboard = json.loads((root / "grafana" / "torchkeel-serving.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((root / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    server.request("POST", "/v2/models/tiny/infer", v2(GOOD))  # histograms get samples
    exposed = set(re.findall(r"^([a-z_]+)[{ ]", server.request("GET", "/metrics")[1].decode(), re.M))
    used = {name for e in exprs for name in re.findall(r"\b(nv_[a-z_]+|torchkeel_[a-z_]+)\b", e)}
    assert len(used) >= 10 and used - exposed == set()
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "latency", "batch size", "queue", "drift", "protocol"):
        assert topic in titles
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "label_values(nv_inference_request_success, model)" in variables["model"]["query"]
    assert "version" in variables["version"]["query"] and variables["model"]["multi"]
    panel_exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert all('model=~"$model",version=~"$version"' in e for e in panel_exprs)  # every panel follows the selectors


def test_metrics_parse_with_prometheus_own_parser_and_every_family_is_typed(server):
    from prometheus_client.parser import text_string_to_metric_families

    assert server.request("POST", "/v2/models/tiny/infer", v2(GOOD))[0] == 200
    text = server.request("GET", "/metrics")[1].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {name for name, f in families.items() if f.type == "untyped"} == set()
    for name in (
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
    ):
        assert families[name].type == "counter"
        assert f"# TYPE {name} counter" in text and f"\n{name}{{" in text  # Triton's names, no _total
    success = [s for s in families["nv_inference_request_success"].samples if s.name.endswith("_total")]
    assert success and success[0].value >= 1 and success[0].labels == {"model": "tiny", "version": "1"}
    assert len(families["nv_inference_request_failure"].samples) == 4  # one per reason, from the start
    for name in (
        "torchkeel_drift_alert",
        "torchkeel_drift_window_samples",
        "torchkeel_input_drift_score",
        "nv_inference_pending_request_count",
        "torchkeel_inflight_requests",
    ):
        assert families[name].type == "gauge"
    assert families["torchkeel_request_latency_seconds"].type == "histogram"
    assert families["torchkeel_drift_window_samples"].samples[0].value >= 1
