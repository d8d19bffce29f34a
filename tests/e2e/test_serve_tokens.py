"""A transformers-shaped model behind ``keel serve``: named inputs (``input_ids``,
``attention_mask``) with a dynamic length, over KServe v2 with the real ``tritonclient`` (HTTP
and gRPC) and over v1 as ``{"instances": [{key: ...}]}``; client mistakes are 400s, and
requests of different lengths are each answered with their own rows."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
import tritonclient.grpc as tritongrpc
import tritonclient.http as tritonhttp
from serveproc import Server
from tokens import TinyLM, sequences
from tritonclient.utils import InferenceServerException

from tokenrun import train_tokens
from torchkeel.checkpoint import CheckpointStore
from torchkeel.checkpoint.foreign import checkpoint_weights
from torchkeel.data import PadCollate
from torchkeel.export import export_run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens-serve")
    export_run(train_tokens(out), "onnx", out / "export")
    eager = TinyLM().eval()
    eager.load_state_dict(checkpoint_weights(CheckpointStore(out / "tokens" / "checkpoints").latest_valid()[0]))
    server = Server(out / "export", grpc=True)
    yield server, eager
    assert server.stop() == 0


def batch(lengths, seed=0):
    """Padded input_ids and attention_mask of sequences of the given lengths."""
    samples = [
        {"input_ids": torch.from_numpy(s[:n].astype(np.int64))} for s, n in zip(sequences(len(lengths), seed), lengths)
    ]
    padded = PadCollate()(samples)
    return padded["input_ids"].numpy(), padded["attention_mask"].numpy()


def expected(eager, ids, mask):
    with torch.inference_mode():
        return eager(torch.from_numpy(ids), torch.from_numpy(mask)).logits.numpy()


def test_tritonclient_sends_named_inputs_over_http_and_grpc(served):
    server, eager = served
    ids, mask = batch([5, 9, 7])
    for module, url in ((tritonhttp, server.url), (tritongrpc, server.grpc_url)):
        client = module.InferenceServerClient(url)
        metadata = client.get_model_metadata("tokens")
        names = [i["name"] for i in metadata["inputs"]] if module is tritonhttp else [i.name for i in metadata.inputs]
        assert names == ["input_ids", "attention_mask"]
        inputs = [
            module.InferInput("input_ids", list(ids.shape), "INT64"),
            module.InferInput("attention_mask", list(mask.shape), "INT64"),
        ]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(mask)
        logits = client.infer("tokens", inputs).as_numpy("logits")
        assert logits.shape == (3, 9, 32)
        np.testing.assert_allclose(logits, expected(eager, ids, mask), atol=1e-5)


def test_v1_instances_are_objects_of_the_inputs(served):
    server, eager = served
    ids, mask = batch([6, 6])
    body = {"instances": [{"input_ids": ids[i].tolist(), "attention_mask": mask[i].tolist()} for i in range(2)]}
    status, payload, _ = server.request("POST", "/v1/models/tokens:predict", json.dumps(body))
    assert status == 200, payload
    np.testing.assert_allclose(np.asarray(json.loads(payload)["predictions"]), expected(eager, ids, mask), atol=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/v1/models/tokens:predict",
            {
                "instances": [
                    {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]},
                    {"input_ids": [1, 2], "attention_mask": [1, 1]},
                ]
            },
            "instances[1].input_ids has shape [2], instances[0].input_ids [3]",
        ),
        (
            "/v1/models/tokens:predict",
            {"instances": [{"input_ids": [1, 2, 3]}]},
            "instances[0] lacks ['attention_mask']",
        ),
        (
            "/v1/models/tokens:predict",
            {"instances": [{"input_ids": [1, 2], "attention_mask": [1, 1], "labels": [1, 2]}]},
            "instances[0] has no such inputs ['labels']",
        ),
        (
            "/v1/models/tokens:predict",
            {"instances": [{"input_ids": [1, 99], "attention_mask": [1, 1]}]},
            "instances[*].input_ids holds 99, outside [0, 31]",
        ),
        (
            "/v2/models/tokens/infer",
            {
                "inputs": [
                    {"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]},
                    {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]},
                ]
            },
            "inputs disagree on 'length': 'input_ids' has 3, 'attention_mask' has 2",
        ),
        (
            "/v2/models/tokens/infer",
            {
                "inputs": [
                    {"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [-1, 2]},
                    {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]},
                ]
            },
            "inputs[0] 'input_ids' holds -1, outside [0, 31]",
        ),
        (
            "/v2/models/tokens/infer",
            {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]}]},
            "'inputs' lacks ['attention_mask']",
        ),
    ],
)
def test_client_mistakes_are_400s_that_name_the_field(served, path, body, message):
    server, _ = served
    status, payload, _ = server.request("POST", path, json.dumps(body))
    assert status == 400 and message in json.loads(payload)["error"], payload
    assert server.request("GET", "/v2/health/ready")[0] == 200


def test_out_of_range_ids_over_grpc_are_invalid_argument(served):
    server, _ = served
    client = tritongrpc.InferenceServerClient(server.grpc_url)
    inputs = [
        tritongrpc.InferInput("input_ids", [1, 2], "INT64"),
        tritongrpc.InferInput("attention_mask", [1, 2], "INT64"),
    ]
    inputs[0].set_data_from_numpy(np.array([[3, 1000]], dtype=np.int64))
    inputs[1].set_data_from_numpy(np.ones((1, 2), dtype=np.int64))
    with pytest.raises(InferenceServerException, match="1000, outside"):
        client.infer("tokens", inputs)


def test_concurrent_requests_of_different_lengths_each_get_their_rows(served):
    server, eager = served
    results, errors = {}, []

    def client(i: int) -> None:
        try:
            ids, mask = batch([3 + i % 5], seed=100 + i)
            body = {
                "inputs": [
                    {
                        "name": "input_ids",
                        "datatype": "INT64",
                        "shape": list(ids.shape),
                        "data": ids.flatten().tolist(),
                    },
                    {
                        "name": "attention_mask",
                        "datatype": "INT64",
                        "shape": list(mask.shape),
                        "data": mask.flatten().tolist(),
                    },
                ]
            }
            for _ in range(3):
                status, payload, _ = server.request("POST", "/v2/models/tokens/infer", json.dumps(body))
                assert status == 200, payload
                out = json.loads(payload)["outputs"][0]
                results.setdefault(i, []).append((ids, mask, np.asarray(out["data"], np.float32).reshape(out["shape"])))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and len(results) == 24
    for answers in results.values():
        for ids, mask, got in answers:
            np.testing.assert_allclose(got, expected(eager, ids, mask), atol=1e-5)
