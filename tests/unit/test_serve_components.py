"""The serving components on their own: protocol parsing and encoding, the batcher, drift."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from torchkeel.export.stats import reference_stats
from torchkeel.serve.batcher import DynamicBatcher, QueueFull, QueueTimeout
from torchkeel.serve.drift import DriftMonitor
from torchkeel.serve.protocol import (
    HEADER_LENGTH, ProtocolError, TensorSpec, encode_infer, parse_infer, parse_v1, top_k,
)

IN = [TensorSpec("input", "FP32", [-1, 2, 3])]
OUT = [TensorSpec("output", "FP32", [-1, 4])]


def binary_request(arrays: dict[str, np.ndarray], datatype="FP32", **extra) -> tuple[bytes, str]:
    inputs = [{"name": n, "shape": list(a.shape), "datatype": datatype, "parameters": {"binary_data_size": a.nbytes}}
              for n, a in arrays.items()]
    header = json.dumps({"inputs": inputs, **extra}).encode()
    return header + b"".join(a.tobytes() for a in arrays.values()), str(len(header))


def test_json_nested_and_flat_data_and_id():
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    for data in (x.tolist(), x.reshape(-1).tolist()):
        body = json.dumps({"id": "a1", "inputs": [{"name": "input", "shape": [2, 2, 3], "datatype": "FP32", "data": data}]})
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
    header = json.dumps({"inputs": [{"name": "input", "shape": [2, 2], "datatype": "BF16",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    req = parse_infer(header + raw, str(len(header)), spec, OUT, 64)
    assert req.inputs["input"].tolist() == [[1.5, -2.0], [0.25, 3.0]]
    with pytest.raises(ProtocolError, match="BF16 tensors must be sent as binary"):
        parse_infer(json.dumps({"inputs": [{"name": "input", "shape": [1, 2], "datatype": "BF16", "data": [1, 2]}]}).encode(),
                    None, spec, OUT, 64)


@pytest.mark.parametrize("datatype,dtype", [("FP64", np.float64), ("FP16", np.float16), ("INT64", np.int64),
                                            ("INT32", np.int32), ("UINT8", np.uint8), ("BOOL", np.bool_)])
def test_datatypes(datatype, dtype):
    spec = [TensorSpec("input", datatype, [-1, 3])]
    x = np.array([[1, 0, 1]], dtype=dtype)
    body, length = binary_request({"input": x}, datatype=datatype)
    assert parse_infer(body, length, spec, OUT, 64).inputs["input"].dtype == dtype
    json_body = json.dumps({"inputs": [{"name": "input", "shape": [1, 3], "datatype": datatype,
                                        "data": x.tolist()}]}).encode()
    assert np.array_equal(parse_infer(json_body, None, spec, OUT, 64).inputs["input"], x)


def test_requested_outputs_choose_the_encoding():
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 2, 3], "datatype": "FP32", "data": [0] * 6}],
                       "outputs": [{"name": "output", "parameters": {"binary_data": False}}],
                       "parameters": {"binary_data_output": True}}).encode()
    req = parse_infer(body, None, IN, OUT, 64)
    assert req.outputs == {"output": False}
    payload, headers = encode_infer("m", "1", req, {"output": np.zeros((1, 4), np.float32)})
    assert headers == {} and json.loads(payload)["outputs"][0]["data"] == [0.0] * 4


def test_nonfinite_inputs_are_refused_unless_allowed():
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 2, 3], "datatype": "FP32",
                                   "data": [0, 0, 0, 0, 0, float("inf")]}]}).encode()
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


def test_batcher_stacks_concurrent_requests_and_splits_answers():
    batches = []

    def model(x):
        batches.append(len(x))
        return x * 2

    async def main():
        batcher = DynamicBatcher(model, max_batch_size=8, max_queue_delay_ms=50)
        await batcher.start()
        inputs = [np.full((1, 3), i, dtype=np.float32) for i in range(20)]
        outputs = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        await batcher.stop()
        return inputs, outputs

    inputs, outputs = run(main())
    assert all(np.array_equal(o, x * 2) for x, o in zip(inputs, outputs))
    assert sum(batches) == 20 and max(batches) == 8 and len(batches) <= 4


def test_a_lone_request_is_not_kept_waiting():
    async def main():
        # A batcher that waited for the batch to fill would sit out the whole hour.
        batcher = DynamicBatcher(lambda x: x, max_batch_size=64, max_queue_delay_ms=3_600_000)
        await batcher.start()
        answer = await asyncio.wait_for(batcher.submit(np.ones((1, 2))), timeout=60)
        await batcher.stop()
        return answer

    assert run(main()).tolist() == [[1.0, 1.0]]


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


def test_drift_psi_and_out_of_range():
    rng = np.random.default_rng(0)
    reference = reference_stats(rng.normal(size=(5000, 3)))
    same, shifted = DriftMonitor(reference), DriftMonitor(reference)
    for _ in range(100):
        same.observe(rng.normal(size=(10, 3)))
        shifted.observe(rng.normal(loc=[0.0, 0.0, 3.0], size=(10, 3)))
    calm, drifted = same.read(), shifted.read()
    assert not calm["alert"] and max(calm["psi"]) < 0.05 and max(calm["out_of_range"]) < 0.01
    assert drifted["alert"] and drifted["psi"][2] > 1.0 and drifted["psi"][0] < 0.05
    assert drifted["out_of_range"][2] > 0.3


def test_drift_per_channel_for_images():
    reference = reference_stats(np.random.default_rng(0).uniform(size=(100, 2, 4, 4)))
    assert reference["layout"] == "channels" and len(reference["features"]) == 2
    monitor = DriftMonitor(reference)
    monitor.observe(np.zeros((1, 2, 4, 4)))  # a CDN that zeroed every pixel
    assert monitor.read()["alert"]
