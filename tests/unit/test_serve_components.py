"""The serving components on their own: protocol parsing and encoding, the batcher, drift."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from v1body import parse_v1

from torchkeel.export.stats import reference_stats
from torchkeel.serve.batcher import DynamicBatcher, QueueFull, QueueTimeout
from torchkeel.serve.drift import DriftMonitor
from torchkeel.serve.protocol import (
    HEADER_LENGTH,
    ProtocolError,
    TensorSpec,
    encode_infer,
    parse_infer,
    top_k,
)

IN = [TensorSpec("input", "FP32", [-1, 2, 3])]
OUT = [TensorSpec("output", "FP32", [-1, 4])]


def binary_request(arrays: dict[str, np.ndarray], datatype="FP32", **extra) -> tuple[bytes, str]:
    inputs = [
        {"name": n, "shape": list(a.shape), "datatype": datatype, "parameters": {"binary_data_size": a.nbytes}}
        for n, a in arrays.items()
    ]
    header = json.dumps({"inputs": inputs, **extra}).encode()
    return header + b"".join(a.tobytes() for a in arrays.values()), str(len(header))


def test_json_nested_and_flat_data_and_id():
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    for data in (x.tolist(), x.reshape(-1).tolist()):
        body = json.dumps(
            {"id": "a1", "inputs": [{"name": "input", "shape": [2, 2, 3], "datatype": "FP32", "data": data}]}
        )
        req = parse_infer(body.encode(), None, IN, OUT, 64)
        assert req.id == "a1" and np.array_equal(req.inputs["input"], x) and req.outputs is None


def test_binary_inputs_and_binary_outputs_round_trip():
    x = np.random.default_rng(0).normal(size=(3, 2, 3)).astype(np.float32)
    body, length = binary_request({"input": x}, parameters={"binary_data_output": True})
    req = parse_infer(body, length, IN, OUT, 64)
    assert np.array_equal(req.inputs["input"], x)
    y = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    payload, headers = encode_infer("m", "1", req, {"output": y})
    n = int(headers[HEADER_LENGTH])
    doc = json.loads(payload[:n])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == y.nbytes and "data" not in doc["outputs"][0]
    assert np.array_equal(np.frombuffer(payload[n:], dtype=np.float32).reshape(3, 4), y)


def test_bf16_travels_as_binary():
    spec = [TensorSpec("input", "BF16", [-1, 2])]
    x = torch.tensor([[1.5, -2.0], [0.25, 3.0]], dtype=torch.bfloat16)
    raw = x.view(torch.int16).numpy().tobytes()
    header = json.dumps(
        {
            "inputs": [
                {"name": "input", "shape": [2, 2], "datatype": "BF16", "parameters": {"binary_data_size": len(raw)}}
            ]
        }
    ).encode()
    req = parse_infer(header + raw, str(len(header)), spec, OUT, 64)
    assert req.inputs["input"].tolist() == [[1.5, -2.0], [0.25, 3.0]]
    with pytest.raises(ProtocolError, match="BF16 tensors must be sent as binary"):
        parse_infer(
            json.dumps({"inputs": [{"name": "input", "shape": [1, 2], "datatype": "BF16", "data": [1, 2]}]}).encode(),
            None,
            spec,
            OUT,
            64,
        )


@pytest.mark.parametrize(
    "datatype,dtype",
    [
        ("FP64", np.float64),
        ("FP16", np.float16),
        ("INT64", np.int64),
        ("INT32", np.int32),
        ("UINT8", np.uint8),
        ("BOOL", np.bool_),
    ],
)
def test_datatypes(datatype, dtype):
    spec = [TensorSpec("input", datatype, [-1, 3])]
    x = np.array([[1, 0, 1]], dtype=dtype)
    body, length = binary_request({"input": x}, datatype=datatype)
    assert parse_infer(body, length, spec, OUT, 64).inputs["input"].dtype == dtype
    json_body = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 3], "datatype": datatype, "data": x.tolist()}]}
    ).encode()
    assert np.array_equal(parse_infer(json_body, None, spec, OUT, 64).inputs["input"], x)


def test_requested_outputs_choose_the_encoding():
    body = json.dumps(
        {
            "inputs": [{"name": "input", "shape": [1, 2, 3], "datatype": "FP32", "data": [0] * 6}],
            "outputs": [{"name": "output", "parameters": {"binary_data": False}}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    req = parse_infer(body, None, IN, OUT, 64)
    assert req.outputs == {"output": False}
    payload, headers = encode_infer("m", "1", req, {"output": np.zeros((1, 4), np.float32)})
    assert headers == {} and json.loads(payload)["outputs"][0]["data"] == [0.0] * 4


def test_nonfinite_inputs_are_refused_unless_allowed():
    body = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 2, 3], "datatype": "FP32", "data": [0, 0, 0, 0, 0, float("inf")]}]}
    ).encode()
    with pytest.raises(ProtocolError, match="holds 1 NaN/Inf values"):
        parse_infer(body, None, IN, OUT, 64)
    assert np.isinf(parse_infer(body, None, IN, OUT, 64, allow_nonfinite=True).inputs["input"]).sum() == 1


def test_v1_and_top_k():
    spec = TensorSpec("input", "FP32", [-1, 2])
    batch, params = parse_v1(json.dumps({"instances": [[1, 2], [3, 4]], "parameters": {"top_k": 1}}).encode(), spec, 64)
    assert batch.shape == (2, 2) and params == {"top_k": 1}
    result = top_k(np.array([[0.0, 2.0, 1.0]]), ["a", "b", "c"], 2)
    assert result[0]["labels"] == ["b", "c"] and result[0]["scores"][0] > result[0]["scores"][1]


def run(coro):
    return asyncio.run(coro)


# Tests that are not about the queue timeout set it to an hour: a machine that stalls the process
# for longer than the default 10 s must not turn a batching test into a QueueTimeout.
HOUR_MS = 3_600_000


def test_batcher_stacks_concurrent_requests_and_splits_answers():
    batches = []

    def model(x):
        batches.append(len(x))
        return x * 2

    async def main():
        batcher = DynamicBatcher(model, max_batch_size=8, max_queue_delay_ms=50, queue_timeout_ms=HOUR_MS)
        await batcher.start()
        inputs = [np.full((1, 3), i, dtype=np.float32) for i in range(20)]
        outputs = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        await batcher.stop()
        return inputs, outputs

    inputs, outputs = run(main())
    assert all(np.array_equal(o, x * 2) for x, o in zip(inputs, outputs))
    assert sum(batches) == 20 and max(batches) == 8 and len(batches) <= 4


def test_threads_submit_into_the_same_batches_as_the_event_loop():
    """gRPC's handler threads and REST's coroutines share one queue: each gets its own rows."""
    import threading

    batches = []
    release = threading.Event()

    def model(x):
        release.wait(5)  # the first forward holds the model while both sides queue up
        batches.append(len(x))
        return x * 3

    async def main():
        batcher = DynamicBatcher(model, max_batch_size=64, inline_max_ms=0, queue_timeout_ms=HOUR_MS)
        await batcher.start()
        loop_inputs = [np.full((1, 2), i, dtype=np.float32) for i in range(8)]
        thread_inputs = [np.full((2, 2), 100 + i, dtype=np.float32) for i in range(8)]
        first = asyncio.ensure_future(batcher.submit(np.zeros((1, 2), np.float32)))
        await asyncio.sleep(0.05)
        futures = []
        threads = [
            threading.Thread(target=lambda x=x: futures.append((x, batcher.submit_threadsafe(x))))
            for x in thread_inputs
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pending = [asyncio.ensure_future(batcher.submit(x)) for x in loop_inputs]
        await asyncio.sleep(0.05)
        assert batcher.pending == 17
        release.set()
        await first
        answers = await asyncio.gather(*pending)
        from_threads = [(x, await asyncio.wrap_future(f)) for x, f in futures]
        await batcher.stop()
        return loop_inputs, answers, from_threads

    loop_inputs, answers, from_threads = run(main())
    assert all(np.array_equal(a, x * 3) for x, a in zip(loop_inputs, answers))
    assert all(np.array_equal(a, x * 3) for x, a in from_threads)
    assert batches == [1, 24]  # the 8 thread requests (2 rows each) and the 8 loop requests: one batch


def test_a_lone_request_is_not_kept_waiting():
    async def main():
        # A batcher that waited for the batch to fill would sit out the whole hour.
        batcher = DynamicBatcher(lambda x: x, max_batch_size=64, max_queue_delay_ms=HOUR_MS, queue_timeout_ms=HOUR_MS)
        await batcher.start()
        answer = await asyncio.wait_for(batcher.submit(np.ones((1, 2))), timeout=60)
        await batcher.stop()
        return answer

    assert run(main()).tolist() == [[1.0, 1.0]]


def test_requests_arriving_while_the_model_is_busy_form_the_next_batch_at_once():
    """The delay only ever fills an idle model: in front of a busy one nobody waits."""
    import threading

    batches, release = [], threading.Event()

    def model(x):
        batches.append(len(x))
        if len(batches) == 1:
            release.wait(10)  # the first forward is busy until the burst is queued
        return x + 1

    async def main():
        batcher = DynamicBatcher(model, max_batch_size=64, max_queue_delay_ms=HOUR_MS, queue_timeout_ms=HOUR_MS)
        await batcher.start()
        first = asyncio.ensure_future(batcher.submit(np.zeros((1, 2))))
        await asyncio.sleep(0.05)
        burst = [asyncio.ensure_future(batcher.submit(np.full((1, 2), i))) for i in range(10)]
        await asyncio.sleep(0.05)
        release.set()
        answers = await asyncio.wait_for(asyncio.gather(first, *burst), timeout=60)
        await batcher.stop()
        return answers

    answers = run(main())
    assert batches == [1, 10]
    assert [a.tolist() for a in answers[1:]] == [[[i + 1.0, i + 1.0]] for i in range(10)]


def test_fast_models_run_on_the_event_loop_and_slow_ones_on_the_model_thread():
    import threading

    def check(delay_s):
        threads = []
        now = [0.0]

        def model(x):  # takes delay_s on the batcher's clock: a busy machine cannot stretch it
            threads.append(threading.get_ident())
            now[0] += delay_s
            return x

        async def main():
            batcher = DynamicBatcher(model, inline_max_ms=10, clock=lambda: now[0])
            await batcher.start()
            for _ in range(5):  # one at a time: each finds the model idle
                await batcher.submit(np.ones((1, 1)))
            await batcher.stop()
            return threading.get_ident()

        loop_thread = run(main())
        return [t == loop_thread for t in threads]

    assert check(0.0) == [False, True, True, True, True]  # measured once on the thread, then inline
    assert check(0.03) == [False] * 5


def test_a_burst_after_quiet_traffic_is_still_batched():
    batches = []

    def model(x):
        batches.append(len(x))
        return x * 3

    async def main():
        batcher = DynamicBatcher(model, max_batch_size=64, queue_timeout_ms=HOUR_MS)
        await batcher.start()
        for i in range(40):  # a lone client: every request runs alone, inline
            await batcher.submit(np.full((1, 1), i))
        quiet = len(batches)
        inputs = [np.full((1, 1), i) for i in range(200)]
        outputs = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        await batcher.stop()
        return quiet, inputs, outputs

    quiet, inputs, outputs = run(main())
    assert quiet == 40 and all(np.array_equal(o, x * 3) for x, o in zip(inputs, outputs))
    burst = batches[quiet:]
    assert sum(burst) == 200 and len(burst) <= 40 and max(burst) >= 32


def test_queue_full_and_queue_timeout():
    import threading

    gate = threading.Event()

    def slow(x):
        gate.wait(5)
        return x

    async def main():
        batcher = DynamicBatcher(slow, max_batch_size=1, max_queue=2, queue_timeout_ms=50, max_queue_delay_ms=0)
        await batcher.start()
        first = asyncio.ensure_future(batcher.submit(np.zeros((1, 1))))
        await asyncio.sleep(0.05)  # the first is computing, blocked on the gate
        waiting = [asyncio.ensure_future(batcher.submit(np.zeros((1, 1)))) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull):
            await batcher.submit(np.zeros((1, 1)))
        await asyncio.sleep(0.1)  # longer than the queue timeout
        gate.set()
        await first
        results = await asyncio.gather(*waiting, return_exceptions=True)
        await batcher.stop()
        return results

    results = run(main())
    assert all(isinstance(r, QueueTimeout) for r in results)


def regression_inputs(n, seed):
    """A 10-feature regression's inputs: correlated, skewed and scaled features, as real data are."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, 10))
    x = base @ np.random.default_rng(99).normal(size=(10, 10)) * 0.3 + base
    x[:, 0] = np.exp(x[:, 0] / 2)  # a skewed feature
    x[:, 1] *= 1000.0
    return x


def test_drift_never_alarms_on_in_distribution_traffic_at_any_window_size():
    reference = reference_stats(regression_inputs(2048, seed=0))  # what the export keeps
    held_out = regression_inputs(1000, seed=1)  # the model's own validation split
    monitor = DriftMonitor(reference)
    readings = []
    for row in held_out:  # one sample per request, the alert read after every one
        monitor.observe(row[None])
        readings.append(monitor.read())
    assert not any(r["alert"] for r in readings)
    assert [r["samples"] for r in readings[:3]] == [1, 2, 3] and readings[-1]["samples"] == 300  # the window
    assert max(max(r["score"]) for r in readings) < 0.8  # not a near miss


@pytest.mark.parametrize("feature", [0, 1, 7])
def test_one_feature_shifted_by_two_sigma_alerts_within_200_requests(feature):
    train = regression_inputs(2048, seed=0)
    monitor = DriftMonitor(reference_stats(train))
    for row in regression_inputs(500, seed=2):  # a full window of normal traffic first
        monitor.observe(row[None])
    assert not monitor.read()["alert"]
    shifted = regression_inputs(200, seed=3)
    shifted[:, feature] += 2 * train[:, feature].std()
    for i, row in enumerate(shifted, start=1):
        monitor.observe(row[None])
        reading = monitor.read()
        if reading["alert"]:
            break
    assert reading["alert"], "no alert after 200 shifted requests"
    assert int(np.argmax(reading["score"])) == feature and reading["score"][feature] > 1
    assert i <= 200


def test_a_client_cycling_through_a_small_validation_set_is_not_drift_but_its_shift_is():
    train = regression_inputs(2048, seed=0)
    monitor = DriftMonitor(reference_stats(train))
    val = regression_inputs(100, seed=5)
    rng = np.random.default_rng(0)
    for _ in range(1000):  # the same 100 inputs again and again
        monitor.observe(val[rng.integers(0, 100)][None])
        assert not monitor.read()["alert"]
    assert 80 <= monitor.read()["distinct_samples"] <= 100
    shifted = val.copy()
    shifted[:, 4] += 2 * train[:, 4].std()
    for i in range(1, 201):
        monitor.observe(shifted[rng.integers(0, 100)][None])
        if monitor.read()["alert"]:
            break
    assert monitor.read()["alert"], "the shifted inputs were not flagged within 200 requests"


def test_drift_psi_and_out_of_range_are_reported_per_feature():
    rng = np.random.default_rng(0)
    reference = reference_stats(rng.normal(size=(5000, 3)))
    same, shifted = DriftMonitor(reference), DriftMonitor(reference)
    for _ in range(100):
        same.observe(rng.normal(size=(10, 3)))
        shifted.observe(rng.normal(loc=[0.0, 0.0, 3.0], size=(10, 3)))
    calm, drifted = same.read(), shifted.read()
    assert not calm["alert"] and max(calm["psi"]) < 0.25 and max(calm["out_of_range"]) < 0.01
    assert drifted["alert"] and drifted["psi"][2] > 1.0 and drifted["psi"][0] < 0.25
    assert drifted["out_of_range"][2] > 0.2 and drifted["score"][2] > 1 > drifted["score"][0]


def test_too_few_samples_never_alert():
    reference = reference_stats(np.random.default_rng(0).normal(size=(2000, 4)))
    monitor = DriftMonitor(reference)
    far = np.random.default_rng(1).normal(loc=50.0, size=(monitor.min_samples, 4))
    monitor.observe(far[:-1])  # far out, but not enough samples yet
    assert not monitor.read()["alert"]
    monitor.observe(far[-1:])
    assert monitor.read()["alert"]


def test_drift_per_channel_for_images():
    reference = reference_stats(np.random.default_rng(0).uniform(size=(100, 2, 4, 4)))
    assert reference["layout"] == "channels" and len(reference["features"]) == 2
    monitor = DriftMonitor(reference)
    for _ in range(monitor.min_samples - 1):
        monitor.observe(np.random.default_rng(1).uniform(size=(1, 2, 4, 4)))
    assert monitor.read()["samples"] == monitor.min_samples - 1  # a sample is an image, not a pixel
    calm = DriftMonitor(reference)
    for i in range(300):
        calm.observe(np.random.default_rng(i + 10).uniform(size=(1, 2, 4, 4)))
        assert not calm.read()["alert"]
    zeroed = DriftMonitor(reference)
    for _ in range(zeroed.min_samples):
        zeroed.observe(np.zeros((1, 2, 4, 4)))  # a CDN that zeroed every pixel
    assert zeroed.read()["alert"]


@pytest.mark.parametrize(
    "path, route",
    [
        ("/v2/models/tiny/infer", ("v2", "tiny", None)),
        ("/v2/models/tiny/versions/1/infer", ("v2", "tiny", "1")),
        ("/v1/models/tiny:predict", ("v1", "tiny", None)),
        ("/v2/models//infer", None),
        ("/v2/models/tiny/versions//infer", None),
        ("/v2/models/a/b/infer", None),
        ("/v2/models/tiny/generate", None),
        ("/v1/models/:predict", None),
        ("/v1/models/a/b:predict", None),
        ("/v1/models/tiny", None),
        ("/v1/completions", None),
    ],
)
def test_inference_route_answers_the_two_inference_routes_only(path, route):
    """The paths answered ahead of Starlette's router: its two inference routes, and nothing else."""
    from torchkeel.serve.app import inference_route

    assert inference_route(path) == route
