"""One ``keel serve`` of a directory of exports — a tensor model, an image model and a broken one —
over REST and gRPC, driven by the real ``tritonclient`` (HTTP and gRPC) and raw HTTP."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import threading

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tritongrpc
import tritonclient.http as tritonhttp
from PIL import Image
from serveproc import Server, eager_rows, exported, image_exported, metric  # noqa: F401 - fixtures
from tritonclient.utils import InferenceServerException

from imagedata import EncodedImages, encode, image_pixels
from torchkeel.data.build import transformed_datasets
from torchkeel.serve.model import ServeOptions
from torchkeel.serve.server import Server as ServerParts


@pytest.fixture(scope="module")
def repository(exported, image_exported, tmp_path_factory):
    root = tmp_path_factory.mktemp("repository")
    shutil.copytree(exported[0], root / "tiny")
    shutil.copytree(image_exported[0], root / "colours")
    shutil.copytree(exported[0], root / "broken")
    meta = json.loads((root / "broken" / "model.json").read_text())
    (root / "broken" / "model.json").write_text(json.dumps({**meta, "name": "broken"}))
    (root / "broken" / meta["file"]).write_bytes(b"not a TorchScript archive")
    return root


@pytest.fixture(scope="module")
def server(repository):
    srv = Server(repository, "--max-body-mb", "1", grpc=True)
    yield srv
    assert srv.stop() == 0
    assert "not serving broken from" in srv.stderr and "serving colours (version 1, images or tensors)" in srv.stdout


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def softmax(rows: np.ndarray) -> np.ndarray:
    e = np.exp(rows.astype(np.float64) - rows.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def training_tensors(image_exported, indices) -> np.ndarray:
    """The training pipeline's tensors of some training samples (data.preprocess as the loader applies it)."""
    train, _ = transformed_datasets(image_exported[2].data)
    return np.stack([train[i][0].numpy() for i in indices])


def v1(server, model, instances, **parameters):
    doc = {"instances": instances, **({"parameters": parameters} if parameters else {})}
    status, body, _ = server.request("POST", f"/v1/models/{model}:predict", json.dumps(doc))
    return status, json.loads(body)


# ---- several models -------------------------------------------------------------------------


def test_the_index_lists_each_model_with_its_state_and_a_broken_one_does_not_stop_the_others(server):
    status, body, _ = server.request("POST", "/v2/repository/index", "{}")
    index = {row["name"]: row for row in json.loads(body)}
    assert status == 200 and set(index) == {"broken", "colours", "tiny"}
    assert index["tiny"]["state"] == index["colours"]["state"] == "READY"
    assert index["broken"]["state"] == "UNAVAILABLE" and "RuntimeError" in index["broken"]["reason"]
    assert server.request("GET", "/v2/health/ready")[0] == 200
    status, body, _ = server.request("POST", "/v1/models/broken:predict", json.dumps({"instances": [[0.0] * 32]}))
    assert (
        status == 503 and "model 'broken' is unavailable: it failed to load (RuntimeError" in json.loads(body)["error"]
    )
    status, body, _ = server.request("GET", "/v2/models/nope")
    assert status == 404 and "['colours', 'tiny']" in json.loads(body)["error"]
    assert json.loads(server.request("GET", "/v1/models")[1])["models"] == ["colours", "tiny"]  # and OpenAI's data


def test_each_model_has_its_own_metrics_and_drift(server, exported):
    before = {m: metric(server, "nv_inference_count", model=m, version="1") for m in ("tiny", "colours")}
    window = metric(server, "torchkeel_drift_window_samples", model="colours")
    for seed in range(3):
        assert v1(server, "tiny", np.random.default_rng(seed).normal(size=(2, 32)).tolist())[0] == 200
    images = [{"image_bytes": {"b64": b64(encode(image_pixels(1, 50 + i)))}} for i in range(5)]
    assert v1(server, "colours", images)[0] == 200
    assert metric(server, "nv_inference_count", model="tiny", version="1") - before["tiny"] == 6
    assert metric(server, "nv_inference_count", model="colours", version="1") - before["colours"] == 5
    # Drift sees the preprocessed tensors of the images, per channel, for that model only.
    assert metric(server, "torchkeel_drift_window_samples", model="colours") - window == 5
    text = server.request("GET", "/metrics")[1].decode()
    for feature in range(3):
        assert f'torchkeel_input_drift_score{{feature="{feature}",model="colours",version="1"}}' in text
    assert 'torchkeel_input_drift_score{feature="3",model="colours"' not in text
    assert text.count("# TYPE nv_inference_count counter") == 1  # one family, a series per model


def test_a_name_served_twice_and_a_directory_without_exports_are_reported(exported, tmp_path):
    (tmp_path / "empty").mkdir()
    parts = ServerParts([exported[0], exported[0], tmp_path / "empty"], ServeOptions())
    assert sorted(parts.repository.models) == ["tiny"]
    reasons = [u.reason for u in parts.repository.unavailable]
    assert "the name 'tiny' is already served from" in reasons[0] and "no model.json in it" in reasons[1]
    parts.images.shutdown()


# ---- images in, labels out ------------------------------------------------------------------


def test_the_server_preprocesses_an_image_exactly_as_training_did(image_exported):
    """No train/serve skew: the training loader's tensor and the server's, from the same encoded image."""
    dataset = EncodedImages(96, 0)  # the training set of the run, as encoded bytes
    indices = [0, 1, 2, 3, 7]
    parts = ServerParts([image_exported[0]], ServeOptions())
    model = parts.repository.models["colours"]
    served = asyncio.run(model.images([dataset[i][0] for i in indices], [f"image {i}" for i in indices]))
    parts.images.shutdown()
    expected = training_tensors(image_exported, indices)
    assert served.shape == expected.shape == (5, 3, 16, 16)
    assert float(np.abs(served - expected).max()) <= 1e-6


class _Recording:
    """An image preprocess that notes the thread it ran on."""

    def __init__(self, preprocess) -> None:
        self.preprocess, self.threads = preprocess, []

    def array(self, image, max_pixels):
        self.threads.append(threading.current_thread().name)
        return self.preprocess.array(image, max_pixels)


def test_images_are_preprocessed_off_the_event_loop_and_batched_like_any_request(image_exported):
    dataset = EncodedImages(96, 0)
    parts = ServerParts([image_exported[0]], ServeOptions(max_queue_delay_ms=200, inline_max_ms=0))
    model = parts.repository.models["colours"]
    model.preprocess = recording = _Recording(model.preprocess)

    async def main():
        await parts.repository.start()
        loop_thread = threading.current_thread().name

        async def one(i: int):
            return await model.predict(await model.images([dataset[i][0]], [f"image {i}"]))

        answers = await asyncio.gather(*(one(i) for i in range(8)))
        await parts.repository.stop()
        return loop_thread, answers

    loop_thread, answers = asyncio.run(main())
    parts.images.shutdown()
    assert len(recording.threads) == 8 and loop_thread not in recording.threads
    assert all(name.startswith("torchkeel-image") for name in recording.threads)
    with torch.inference_mode():
        expected = image_exported[1](torch.from_numpy(training_tensors(image_exported, range(8)))).numpy()
    np.testing.assert_allclose(np.concatenate(answers), expected, atol=1e-5)
    text = parts.metrics.render().decode()
    executions = float(
        next(line for line in text.splitlines() if line.startswith("nv_inference_exec_count{")).rsplit(" ", 1)[1]
    )
    assert executions < 8  # the eight single-image requests shared forwards


def test_v1_image_bytes_give_labels_with_scores(server, image_exported):
    dataset = EncodedImages(96, 0)
    indices = [4, 5, 6]  # a JPEG and PNGs, of three sizes
    status, answer = v1(server, "colours", [{"image_bytes": {"b64": b64(dataset[i][0])}} for i in indices])
    assert status == 200 and len(answer["predictions"]) == 3
    with torch.inference_mode():
        expected = softmax(image_exported[1](torch.from_numpy(training_tensors(image_exported, indices))).numpy())
    for row, probs in zip(answer["predictions"], expected):
        order = np.argsort(-probs)
        assert [p["label"] for p in row] == [["red", "green", "blue"][j] for j in order]  # 3 classes: all, best first
        np.testing.assert_allclose([p["score"] for p in row], probs[order], atol=1e-5)
    status, answer = v1(server, "colours", [{"b64": b64(dataset[4][0])}], top_k=1)
    assert status == 200 and len(answer["predictions"][0]) == 1


def test_v2_bytes_over_http_binary_and_json_base64_and_over_grpc(server, image_exported):
    blobs = [encode(image_pixels(i % 3, 900 + i, (30 + i, 25)), "JPEG" if i % 2 else "PNG") for i in range(4)]
    images = np.empty(4, dtype=object)
    images[:] = blobs
    with torch.inference_mode():
        from torchkeel.data.images import ImagePreprocess

        spec = json.loads((image_exported[0] / "model.json").read_text())["preprocess"]
        batch = np.stack([ImagePreprocess.from_spec(spec).array(b) for b in blobs])
        expected = image_exported[1](torch.from_numpy(batch)).numpy()

    http = tritonhttp.InferenceServerClient(server.url)
    meta = http.get_model_metadata("colours")
    assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1]}]
    tensor = tritonhttp.InferInput("image", [4], "BYTES")
    tensor.set_data_from_numpy(images, binary_data=True)
    result = http.infer("colours", [tensor], outputs=[tritonhttp.InferRequestedOutput("output", binary_data=True)])
    np.testing.assert_allclose(result.as_numpy("output"), expected, atol=1e-5)
    classes = http.infer("colours", [tensor], outputs=[tritonhttp.InferRequestedOutput("output", class_count=2)])
    first = classes.as_numpy("output")[0]
    best = np.argsort(-expected[0])[:2]
    assert [c.decode().split(":")[1:] for c in first] == [[str(j), ["red", "green", "blue"][j]] for j in best]
    http.close()

    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [4, 1], "data": [b64(b) for b in blobs]}]}
    status, payload, _ = server.request("POST", "/v2/models/colours/infer", json.dumps(body))
    out = json.loads(payload)["outputs"][0]
    assert status == 200 and out["shape"] == [4, 3]
    np.testing.assert_allclose(np.reshape(out["data"], (4, 3)), expected, atol=1e-5)

    client = tritongrpc.InferenceServerClient(server.grpc_url)
    tensor = tritongrpc.InferInput("image", [4], "BYTES")
    tensor.set_data_from_numpy(images)
    np.testing.assert_allclose(client.infer("colours", [tensor]).as_numpy("output"), expected, atol=1e-5)
    client.close()


def test_an_image_model_also_takes_the_preprocessed_tensor(server, image_exported):
    x = training_tensors(image_exported, [0, 1])
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 3, 16, 16], "data": x.reshape(-1).tolist()}]}
    status, payload, _ = server.request("POST", "/v2/models/colours/infer", json.dumps(body))
    np.testing.assert_allclose(
        np.reshape(json.loads(payload)["outputs"][0]["data"], (2, 3)), eager_rows(image_exported[1], x), atol=1e-5
    )
    assert status == 200


def _bomb() -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buffer, "PNG")  # 81 Mpx in about 80 kB
    return buffer.getvalue()


def _ico() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, "ICO")
    return buffer.getvalue()


GOOD_IMAGE = encode(image_pixels(0, 7))


@pytest.mark.parametrize(
    "instance,message",
    [
        (
            {"image_bytes": {"b64": b64(b"\x89PNG\r\n\x1a\n garbage")}},
            "instances[1].image_bytes: not a decodable image",
        ),
        ({"image_bytes": {"b64": b64(_ico())}}, "instances[1].image_bytes: ICO images are not accepted"),
        (
            {"image_bytes": {"b64": b64(_bomb())}},
            "instances[1].image_bytes: the image is 9000×9000 = 81,000,000 pixels, over the limit",
        ),
        ({"image_bytes": {"b64": b64(GOOD_IMAGE[:200])}}, "instances[1].image_bytes: the PNG image cannot be decoded"),
        ({"image_bytes": {"b64": "***"}}, "instances[1].image_bytes.b64 is not valid base64"),
        ({"image_bytes": "abc"}, 'instances[1].image_bytes must be {"image_bytes": {"b64"'),
        ([0.0, 1.0], 'instances[1] must be {"image_bytes": {"b64"'),
    ],
    ids=["garbage", "ico", "bomb", "truncated", "base64", "no-b64", "not-an-object"],
)
def test_a_bad_image_is_a_400_naming_the_instance_and_the_server_stays_up(server, instance, message):
    status, answer = v1(server, "colours", [{"image_bytes": {"b64": b64(GOOD_IMAGE)}}, instance])
    assert status == 400 and message in answer["error"], answer
    assert server.request("GET", "/v2/health/ready")[0] == 200
    assert v1(server, "colours", [{"image_bytes": {"b64": b64(GOOD_IMAGE)}}])[0] == 200


def test_bad_images_over_v2_and_grpc_name_the_item(server):
    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2], "data": [b64(GOOD_IMAGE), b64(b"junk")]}]}
    status, payload, _ = server.request("POST", "/v2/models/colours/infer", json.dumps(body))
    assert status == 400 and "input 'image' item 1: not a decodable image" in json.loads(payload)["error"]
    client = tritongrpc.InferenceServerClient(server.grpc_url)
    images = np.array([GOOD_IMAGE, _ico()], dtype=object)
    tensor = tritongrpc.InferInput("image", [2], "BYTES")
    tensor.set_data_from_numpy(images)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("colours", [tensor])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'image' item 1: ICO images are not accepted" in caught.value.message()
    client.close()


def test_tensor_models_say_they_take_no_images(server):
    status, answer = v1(server, "tiny", [{"image_bytes": {"b64": b64(GOOD_IMAGE)}}])
    assert status == 400 and "model 'tiny' takes FP32 tensors of shape [-1, 32], not images" in answer["error"]


# ---- gRPC -----------------------------------------------------------------------------------


def test_grpc_metadata_and_readiness(server):
    client = tritongrpc.InferenceServerClient(server.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("colours", "1")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "torchkeel" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("tiny", as_json=True)
    assert model["platform"] == "pytorch_libtorch" and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "32"]}]
    assert client.get_model_metadata("colours", as_json=True)["inputs"][0]["datatype"] == "BYTES"
    client.close()


def grpc_error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def test_grpc_errors_are_status_codes_naming_the_field(server):
    client = tritongrpc.InferenceServerClient(server.grpc_url)

    def tensor(shape, datatype="FP32", value=None):
        t = tritongrpc.InferInput("input", list(shape), datatype)
        t.set_data_from_numpy(np.zeros(shape, np.float32) if value is None else value)
        return t

    wrong = grpc_error(lambda: client.infer("tiny", [tensor((2, 31))]))
    assert wrong.status() == "StatusCode.INVALID_ARGUMENT" and "inputs[0].shape is [2, 31]" in wrong.message()
    dtype = grpc_error(lambda: client.infer("tiny", [tensor((1, 32), "FP64", np.zeros((1, 32)))]))
    assert dtype.status() == "StatusCode.INVALID_ARGUMENT" and "inputs[0].datatype is 'FP64'" in dtype.message()
    nan = np.zeros((1, 32), np.float32)
    nan[0, 3] = np.nan
    assert "holds 1 NaN/Inf values" in grpc_error(lambda: client.infer("tiny", [tensor((1, 32), value=nan)])).message()
    unknown = grpc_error(lambda: client.infer("nope", [tensor((1, 32))]))
    assert unknown.status() == "StatusCode.NOT_FOUND" and "unknown model 'nope'" in unknown.message()
    version = grpc_error(lambda: client.get_model_metadata("tiny", "7"))
    assert version.status() == "StatusCode.NOT_FOUND" and "no version '7'" in version.message()
    broken = grpc_error(lambda: client.infer("broken", [tensor((1, 32))]))
    assert broken.status() == "StatusCode.UNAVAILABLE" and "failed to load" in broken.message()
    output = grpc_error(
        lambda: client.infer("tiny", [tensor((1, 32))], outputs=[tritongrpc.InferRequestedOutput("logits")])
    )
    assert "outputs[0].name 'logits' is not an output" in output.message()
    big = grpc_error(lambda: client.infer("tiny", [tensor((64, 32)), tensor((1, 32))]))
    assert "is given twice" in big.message()
    assert client.is_server_ready()
    client.close()


def test_grpc_64_concurrent_clients_each_get_their_own_answer(server, exported):
    results, errors = {}, []

    def one(i: int) -> None:
        try:
            client = tritongrpc.InferenceServerClient(server.grpc_url)
            x = np.random.default_rng(1000 + i).normal(size=(1 + i % 3, 32)).astype(np.float32)
            t = tritongrpc.InferInput("input", list(x.shape), "FP32")
            t.set_data_from_numpy(x)
            for _ in range(3):
                results.setdefault(i, []).append((x, client.infer("tiny", [t], request_id=f"r{i}")))
            client.close()
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and len(results) == 64
    for i, answers in results.items():
        for x, result in answers:
            assert result.get_response().id == f"r{i}"
            np.testing.assert_allclose(result.as_numpy("output"), eager_rows(exported[1], x), atol=1e-5)
    assert metric(server, "torchkeel_request_latency_seconds_count", model="tiny", protocol="grpc") >= 64 * 3


def test_grpc_message_over_the_body_limit_is_resource_exhausted(server):
    from torchkeel.serve.grpc import pb

    channel = grpc.insecure_channel(server.grpc_url)
    call = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.ModelInferResponse.FromString,
    )
    request = pb.ModelInferRequest(model_name="tiny", raw_input_contents=[b"\0" * (2**20 + 10)])
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    channel.close()
    assert tritongrpc.InferenceServerClient(server.grpc_url).is_server_live()
